"""`lithos eval`: run a model over a JSONL task file, or compare two configurations on it.

    lithos eval tests/data/arith.jsonl --limit 4
    lithos eval gsm8k/test.jsonl --template gsm8k-chat.json --batch-size 8
    lithos eval tasks.jsonl --compare kernels=fused          # A: as given, B: A with kernels=fused
    lithos eval tasks.jsonl --set temperature=0.7 --seed 1   # any generate keyword, as KEY=VALUE

Results go to --out (default ./eval-results): a JSONL file of records per configuration, which a
rerun of the same command resumes, and a JSON summary; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lithos.errors import LithosError
from lithos.eval.tasks import FORMATS, KINDS


def parse_option(text: str) -> tuple[str, Any]:
    """ "KEY=VALUE" -> (key, value); VALUE is read as JSON when it parses (0.7, true, {...}), else a string."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        raise LithosError(f"option {text!r} is not KEY=VALUE (e.g. kernels=fused, temperature=0.7)")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from lithos.cli import _add_model_options, _add_placement_options

    p.add_argument("task", help="JSONL task file (one JSON object per line; see docs/eval.md)")
    p.add_argument("--template", help="JSON file of task settings: prompt template, few-shot examples, ...")
    p.add_argument("--kind", choices=KINDS, help="task kind, when the task file has no header that says it")
    p.add_argument("--format", choices=FORMATS, help="chat (the model's chat template) or raw completion")
    p.add_argument("--num-fewshot", type=int, help="use the first N few-shot examples of the template")
    p.add_argument("--limit", type=int, help="only the first N items")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate_batch call")
    p.add_argument("--max-new-tokens", type=int, help="default: the task's setting, else by kind")
    _add_model_options(p)
    _add_placement_options(p)
    p.add_argument("--temperature", type=float, help="0 is greedy (the default)")
    p.add_argument("--seed", type=int, help="base seed: batch b uses seed + b (default 0)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other generate keyword (repeatable)"
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also run configuration B = the above with these changes, and report where outputs differ",
    )
    p.add_argument("--out", default="eval-results", help="directory for results (resumable JSONL) and summaries")
    p.add_argument("--restart", action="store_true", help="discard earlier results of this run instead of resuming")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--show", type=int, default=5, help="differing items to print in compare mode")


def main(args: argparse.Namespace) -> int:
    from lithos.eval import RunConfig, compare, evaluate, load_task

    task = load_task(
        args.task, template=args.template, kind=args.kind, format=args.format, num_fewshot=args.num_fewshot
    )
    options: dict[str, Any] = {"kernels": args.kernels}
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.seed is not None:
        options["seed"] = args.seed
    options.update(parse_option(o) for o in args.set)
    config_a = RunConfig(options)
    config_b = RunConfig({**options, **dict(parse_option(o) for o in args.compare)}) if args.compare else None
    if config_b is not None and config_b.options == config_a.options:
        raise LithosError(f"--compare {' '.join(args.compare)} changes nothing: give an option that differs")

    from lithos.cli import load_model

    model = load_model(args)
    run_options = dict(
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        out=args.out,
        restart=args.restart,
        progress=not args.no_progress,
    )
    print(f"{task.name}: {len(task)} items ({task.kind}, {task.template.format}) from {task.path}", file=sys.stderr)
    try:
        if config_b is None:
            run = evaluate(model, task, config_a, **run_options)
            print(run.table())
            print(f"wrote {run.path} and {run.path.with_suffix('.json')}")
        else:
            comparison = compare(model, task, config_a, config_b, **run_options)
            print(comparison.table(show=args.show))
            print(f"wrote {comparison.a.path}, {comparison.b.path} and the comparison JSON in {args.out}")
    except KeyboardInterrupt:
        print(
            f"lithos: interrupted; finished items are saved under {args.out}: run the same command to resume",
            file=sys.stderr,
        )
        return 130
    return 0
