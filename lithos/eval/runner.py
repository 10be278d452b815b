"""Running a task: batches through `Model.generate_batch`, scores, a resumable results file, and
comparison of two configurations on the same items.

A run appends each finished batch to `<out>/<task>.<config>.jsonl` (a header line, then one record
per item) and flushes it, so an interrupted run loses at most the batch in flight; running again
skips the items already there. A record is reused only if its prompt and answer are unchanged
(`Task.item_key`) and the header's model and settings match this run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lithos.errors import LithosError
from lithos.eval.tasks import Item, Task

RESULTS_VERSION = 1
# Options that are attributes of the loaded Model rather than keywords of generate.
MODEL_OPTIONS = ("kernels",)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One configuration to evaluate: generate keywords (temperature, seed, spec, ...) plus model
    options (`kernels`). `seed` is the base seed (batch b uses seed + b); `max_new_tokens`, if
    given, overrides the task's. The prompt format (`raw`) belongs to the task, not here."""

    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    name: str | None = None

    @property
    def label(self) -> str:
        """The name, or the options written as key=value ("default" when there are none)."""
        if self.name:
            return self.name
        return ",".join(f"{k}={_short(v)}" for k, v in sorted(self.options.items())) or "default"

    @property
    def seed(self) -> int:
        return int(self.options.get("seed", 0))

    def generate_options(self) -> dict[str, Any]:
        """Keywords for generate_batch; `seed` and `max_new_tokens` are applied by the runner."""
        return {k: v for k, v in self.options.items() if k not in (*MODEL_OPTIONS, "seed", "max_new_tokens")}

    def model_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if k in MODEL_OPTIONS}


def _short(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=repr)


def _file_label(label: str) -> str:
    safe = re.sub(r"[^\w.=,+-]", "_", label)
    return safe if len(safe) <= 80 else safe[:64] + "-" + hashlib.sha256(label.encode()).hexdigest()[:8]


@contextlib.contextmanager
def _model_options(model, options: Mapping[str, Any]) -> Iterator[None]:
    """Set model-level options (the kernel path) for the duration of a run, then restore them."""
    from lithos.models import family_of

    saved = {k: getattr(model, k) for k in options}
    if "kernels" in options:
        family_of(model.cfg).check_kernel_path(options["kernels"], model.cfg)
    try:
        for k, v in options.items():
            setattr(model, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(model, k, v)


# ---- results -------------------------------------------------------------------------------


@dataclasses.dataclass
class EvalRun:
    """The results of one configuration on one task: a record per item, in task order."""

    task: Task
    config: RunConfig
    records: list[dict[str, Any]]
    identity: dict[str, Any]
    compile_ms: float = 0.0
    path: Path | None = None  # the results file, when the run wrote one

    @property
    def correct(self) -> int:
        return sum(r["correct"] for r in self.records)

    @property
    def accuracy(self) -> float:
        return self.correct / len(self.records) if self.records else 0.0

    @property
    def unparsed(self) -> int:
        return sum(r["extracted"] is None for r in self.records)

    @property
    def items_per_s(self) -> float:
        seconds = sum(r["item_ms"] for r in self.records) / 1e3
        return len(self.records) / seconds if seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over all rows of each batch (throughput, not per-user speed)."""
        seconds = sum(r["item_ms"] for r in self.records) / 1e3
        return sum(r["generated_tokens"] for r in self.records) / seconds if seconds > 0 else 0.0

    @property
    def tokens_per_round(self) -> float | None:
        """Speculative runs: mean tokens a round produced (accepted drafts + the target's token)."""
        spec = [r["spec"] for r in self.records if r.get("spec")]
        rounds = sum(s["rounds"] for s in spec)
        return (sum(s["accepted"] for s in spec) + rounds) / rounds if rounds else None

    @property
    def acceptance_rate(self) -> float | None:
        """Speculative runs: the fraction of drafted tokens accepted."""
        spec = [r["spec"] for r in self.records if r.get("spec")]
        drafted = sum(s["rounds"] * s["draft_tokens"] for s in spec)
        return sum(s["accepted"] for s in spec) / drafted if drafted else None

    def summary(self) -> dict[str, Any]:
        return {
            "task": self.task.name,
            "kind": self.task.kind,
            "task_file": str(self.task.path),
            "config": self.config.label,
            "options": dict(self.config.options),
            **{k: self.identity[k] for k in ("model", "dtype", "max_new_tokens", "batch_size")},
            "items": len(self.records),
            "correct": self.correct,
            "accuracy": self.accuracy,
            "unparsed": self.unparsed,
            "cache_full": sum(r["finish_reason"] == "cache_full" for r in self.records),
            "items_per_s": self.items_per_s,
            "generated_tokens_per_s": self.tokens_per_s,
            "spec_tokens_per_round": self.tokens_per_round,
            "spec_acceptance_rate": self.acceptance_rate,
            "compile_s": self.compile_ms / 1e3,
            "results_file": str(self.path) if self.path else None,
        }

    def table(self) -> str:
        return format_table([self.summary()])


def format_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One line per run: accuracy, unparsed replies, speed, and tokens per round when speculative."""
    width = max([len("config"), *(len(s["config"]) for s in summaries)]) + 2
    header = (
        f"{'task':<16}{'config':<{width}}{'items':>6}{'correct':>8}{'accuracy':>9}{'unparsed':>9}{'items/s':>9}"
        f"{'tok/s':>8}{'tok/round':>10}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        per_round = s.get("spec_tokens_per_round")
        lines.append(
            f"{s['task'][:15]:<16}{s['config']:<{width}}{s['items']:>6}{s['correct']:>8}{s['accuracy']:>9.3f}"
            f"{s['unparsed']:>9}{s['items_per_s']:>9.2f}{s['generated_tokens_per_s']:>8.1f}"
            f"{'-' if per_round is None else f'{per_round:.2f}':>10}"
        )
    return "\n".join(lines)


class ResultsFile:
    """The append-only JSONL file of one run: a header line with the run's identity, then records."""

    def __init__(self, path: Path, identity: dict[str, Any]):
        self.path = path
        self.identity = identity

    def load(self, restart: bool) -> dict[str, dict[str, Any]]:
        """Records already finished, by id (empty when starting fresh); writes the header if new."""
        if restart or not self.path.exists() or self.path.stat().st_size == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"lithos_eval": self.identity}) + "\n")
            return {}
        text = self.path.read_text(encoding="utf-8")
        lines = text.split("\n")
        # An interrupted write leaves at most one partial last line: drop it, keep the rest, and
        # end the file with a newline so that the next record starts a line of its own.
        if lines[-1]:
            try:
                json.loads(lines[-1])
            except json.JSONDecodeError:
                lines[-1] = ""
            else:
                lines.append("")
            self.path.write_text("\n".join(lines))
        try:
            header = json.loads(lines[0])["lithos_eval"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LithosError(
                f"{self.path}:1: not a lithos eval results file: pass restart=True (--restart) to overwrite it, "
                "or another output directory"
            ) from None
        for key in sorted(set(header) | set(self.identity)):
            if header.get(key) != self.identity.get(key):
                raise LithosError(
                    f"{self.path} holds results of another run ({key}: {header.get(key)!r} there, "
                    f"{self.identity.get(key)!r} now): pass restart=True (--restart) to discard them, "
                    "or another output directory"
                )
        done = {}
        for lineno, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                done[record["id"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                raise LithosError(
                    f"{self.path}:{lineno}: corrupt result record: delete that line to redo its item, "
                    "or pass restart=True (--restart)"
                ) from None
        return done

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


# ---- progress --------------------------------------------------------------------------------


class Progress:
    """A tqdm bar with items/s and running accuracy; without tqdm, one line per batch on stderr."""

    def __init__(self, total: int, done: int, correct: int, desc: str, enabled: bool):
        self.total, self.done, self.correct, self.desc = total, done, correct, desc
        self.enabled = enabled
        self.bar = None
        self.started = time.perf_counter()
        self.done_at_start = done
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        # rate_noinv: always items/s (tqdm shows s/item below one item per second otherwise)
        fmt = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
        self.bar = tqdm(
            total=total, initial=done, desc=desc, unit="item", bar_format=fmt, dynamic_ncols=True, file=sys.stderr
        )
        self._postfix()

    def _postfix(self) -> None:
        if self.bar is not None and self.done:
            self.bar.set_postfix(acc=f"{self.correct / self.done:.3f}")

    def update(self, n: int, correct: int) -> None:
        self.done += n
        self.correct += correct
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            self._postfix()
            return
        rate = (self.done - self.done_at_start) / max(time.perf_counter() - self.started, 1e-9)
        print(
            f"{self.desc}: {self.done}/{self.total} items, {rate:.2f} items/s, accuracy {self.correct / self.done:.3f}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- running ---------------------------------------------------------------------------------


def _identity(model, task: Task, config: RunConfig, max_new_tokens: int, batch_size: int) -> dict[str, Any]:
    """What must match for a finished record to be reused (JSON-normalized so a file compares equal)."""
    identity = {
        "version": RESULTS_VERSION,
        "task": task.name,
        "kind": task.kind,
        "model": str(model.checkpoint.source),
        "dtype": str(model.checkpoint.dtype),
        "options": dict(config.options),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
    }
    return json.loads(json.dumps(identity, sort_keys=True, default=repr))


def _generate(model, prompts, max_new_tokens: int, raw: bool, seed: int, config: RunConfig):
    options = config.generate_options()
    try:
        return model.generate_batch(prompts, max_new_tokens=max_new_tokens, raw=raw, seed=seed, **options)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        name = str(e).rsplit("argument", 1)[-1].strip(" '\"")
        raise LithosError(
            f"generate does not take the option {name!r} (config {config.label}): check the spelling, or "
            "whether this version of lithos has it"
        ) from None
    except LithosError as e:
        raise type(e)(f"config {config.label}: {e}") from None


def evaluate(
    model,
    task: Task,
    config: RunConfig | Mapping[str, Any] | None = None,
    *,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    limit: int | None = None,
    out: str | Path | None = None,
    restart: bool = False,
    progress: bool = True,
) -> EvalRun:
    """Run `model` over `task` (its first `limit` items) with `config`, in batches of `batch_size`.

    Items are batched in order of prompt length (less padding); batch b is seeded with
    `config.seed + b`, so a run is reproducible for a given batch size. With `out`, records are
    appended to `<out>/<task>.<config>.jsonl` as batches finish, and a later call with the same
    arguments resumes: finished items are skipped.
    """
    if not isinstance(config, RunConfig):
        config = RunConfig(dict(config or {}))
    if batch_size < 1:
        raise LithosError(f"batch_size must be at least 1, got {batch_size}")
    if "raw" in config.options:
        raise LithosError("'raw' is the task's prompt format, not a run option: set \"format\" in the task or --format")
    max_new_tokens = config.options.get("max_new_tokens") or max_new_tokens or task.template.max_new_tokens
    items = list(task.items[:limit] if limit else task.items)
    raw = task.template.format == "raw"

    prompts = {}
    lengths = {}
    for item in items:
        prompt = task.prompt(item)
        try:
            lengths[item.id] = len(model.prompt_ids(prompt, raw=raw))
        except LithosError as e:
            raise LithosError(f"{task.path}:{item.line} (item {item.id}): {e}") from None
        prompts[item.id] = prompt
    keys = {item.id: task.item_key(item) for item in items}

    identity = _identity(model, task, config, max_new_tokens, batch_size)
    results = None
    done: dict[str, dict[str, Any]] = {}
    path = None
    if out is not None:
        path = Path(out) / f"{_file_label(task.name)}.{_file_label(config.label)}.jsonl"
        results = ResultsFile(path, identity)
        done = {i: r for i, r in results.load(restart).items() if i in keys and r.get("key") == keys[i]}

    # Shortest prompts first, so each batch pads little; the order is fixed by the items alone.
    ordered = sorted(items, key=lambda it: lengths[it.id])
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    bar = Progress(
        total=len(items),
        done=len(done),
        correct=sum(r["correct"] for r in done.values()),
        desc=f"{task.name} [{config.label}]",
        enabled=progress,
    )
    compile_ms = 0.0
    try:
        with _model_options(model, config.model_options()):
            for b, batch in enumerate(batches):
                todo = [it for it in batch if it.id not in done]
                if not todo:
                    continue
                t = time.perf_counter()
                outputs = _generate(
                    model, [prompts[it.id] for it in todo], max_new_tokens, raw, config.seed + b, config
                )
                wall_ms = (time.perf_counter() - t) * 1e3
                batch_compile_ms = outputs[0].compile_ms
                compile_ms += batch_compile_ms
                item_ms = max(wall_ms - batch_compile_ms, 0.0) / len(todo)
                records = [
                    _record(task, item, keys[item.id], result, b, item_ms) for item, result in zip(todo, outputs)
                ]
                if results is not None:
                    results.append(records)
                for r in records:
                    done[r["id"]] = r
                bar.update(len(records), sum(r["correct"] for r in records))
    finally:
        bar.close()

    run = EvalRun(
        task=task,
        config=config,
        records=[done[item.id] for item in items],
        identity=identity,
        compile_ms=compile_ms,
        path=path,
    )
    if path is not None:
        summary = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **run.summary()}
        path.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    return run


def _record(task: Task, item: Item, key: str, result, batch: int, item_ms: float) -> dict[str, Any]:
    score = task.score(item, result.text)
    record = {
        "id": item.id,
        "line": item.line,
        "key": key,
        "correct": score.correct,
        "extracted": score.extracted,
        "expected": task.expected(item),
        "output": result.text,
        "token_ids": result.token_ids,
        "prompt_tokens": result.prompt_tokens,
        "generated_tokens": result.generated_tokens,
        "finish_reason": result.finish_reason,
        "batch": batch,
        "item_ms": item_ms,
    }
    spec = getattr(result, "spec", None)  # a SpecReport when decoded speculatively
    if spec is not None:
        record["spec"] = {
            "drafter": spec.drafter,
            "draft_tokens": spec.draft_tokens,
            "rounds": spec.rounds,
            "accepted": spec.accepted,
        }
    return record


# ---- comparing two configurations ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Difference:
    """An item whose outputs differ between two runs, from token `first_token` on."""

    id: str
    line: int
    first_token: int
    a_output: str
    b_output: str
    a_correct: bool
    b_correct: bool


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where two sequences differ (or where the shorter ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diff_runs(a: EvalRun, b: EvalRun) -> list[Difference]:
    """Items (present in both runs) whose generated tokens differ."""
    b_records = {r["id"]: r for r in b.records}
    found = []
    for ra in a.records:
        rb = b_records.get(ra["id"])
        if rb is None:
            continue
        at = first_difference(ra["token_ids"], rb["token_ids"])
        if at is not None:
            found.append(Difference(ra["id"], ra["line"], at, ra["output"], rb["output"], ra["correct"], rb["correct"]))
    return found


@dataclasses.dataclass
class Comparison:
    """Two runs of the same items and where their outputs differ."""

    a: EvalRun
    b: EvalRun
    differences: list[Difference]

    def summary(self) -> dict[str, Any]:
        return {
            "task": self.a.task.name,
            "a": self.a.summary(),
            "b": self.b.summary(),
            "items": len(self.a.records),
            "differ": len(self.differences),
            "a_right_b_wrong": sum(d.a_correct and not d.b_correct for d in self.differences),
            "a_wrong_b_right": sum(d.b_correct and not d.a_correct for d in self.differences),
            "differences": [dataclasses.asdict(d) for d in self.differences],
        }

    def table(self, show: int = 5) -> str:
        s = self.summary()
        lines = [format_table([s["a"], s["b"]]), ""]
        if not self.differences:
            lines.append(f"outputs identical on all {s['items']} items")
        else:
            lines.append(
                f"outputs differ on {s['differ']} of {s['items']} items "
                f"(A right, B wrong: {s['a_right_b_wrong']}; A wrong, B right: {s['a_wrong_b_right']})"
            )
            for d in self.differences[:show]:
                lines.append(f"  {d.id} (line {d.line}), from token {d.first_token}:")
                lines.append(f"    A: {_snippet(d.a_output)}")
                lines.append(f"    B: {_snippet(d.b_output)}")
            if len(self.differences) > show:
                lines.append(f"  ... and {len(self.differences) - show} more (see the JSON)")
        return "\n".join(lines)


def _snippet(text: str, n: int = 100) -> str:
    text = " ".join(text.split())
    return json.dumps(text if len(text) <= n else text[: n - 3] + "...")


def compare(
    model,
    task: Task,
    a: RunConfig | Mapping[str, Any],
    b: RunConfig | Mapping[str, Any],
    *,
    out: str | Path | None = None,
    **run_options: Any,
) -> Comparison:
    """Run `task` under configurations `a` and `b` (same items, batches and seeds) and report
    where their outputs differ. Greedy runs of equivalent paths (reference vs fused kernels,
    plain vs speculative) must differ nowhere. `run_options` go to `evaluate`."""
    a = a if isinstance(a, RunConfig) else RunConfig(dict(a))
    b = b if isinstance(b, RunConfig) else RunConfig(dict(b))
    if a.label == b.label:
        raise LithosError(
            f"both configurations are named {a.label!r}: give them different names (RunConfig(name=...)) "
            "so that their results files differ"
        )
    run_a = evaluate(model, task, a, out=out, **run_options)
    run_b = evaluate(model, task, b, out=out, **run_options)
    comparison = Comparison(run_a, run_b, diff_runs(run_a, run_b))
    if out is not None:
        path = Path(out) / f"{_file_label(task.name)}.compare.{_file_label(a.label)}.vs.{_file_label(b.label)}.json"
        summary = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **comparison.summary()}
        path.write_text(json.dumps(summary, indent=1) + "\n")
    return comparison
