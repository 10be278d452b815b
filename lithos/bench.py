"""`lithos bench`: decode step time against the memory-bandwidth floor (see BENCHMARKS.md).

For each model shape (random weights) or real checkpoint, each context length and each kernel
path, in one run: the measured read bandwidth, the floor (weight bytes + KV bytes read per step,
over that bandwidth), the median step time of a device-side loop of decode steps, their ratio,
tokens/s and cost per million tokens. With a real checkpoint it also times an end-to-end greedy
generation. Results go to a JSON file under benchmarks/results/, a table is printed last, and a
PNG plots step time against context length with the floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from lithos import decode
from lithos.bandwidth import PROBE_METHOD, measure_read_bandwidth
from lithos.errors import LithosError
from lithos.kv_cache import CACHE_DTYPES, cache_dtype, is_fp8, ring_for
from lithos.models import family_for_architecture, init_model_cache, params_for_kernels
from lithos.quant import bytes_by_format, names_for_groups, quantize_params, random_packed_init
from lithos.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
GENERATION_PROMPT = "Explain in a few paragraphs how a compiler turns source code into machine code."


def configs_dir() -> Path:
    path = Path(os.environ.get("LITHOS_CONFIGS", REPO / "configs"))
    if not path.is_dir():
        raise LithosError(f"no configs directory at {path}: set LITHOS_CONFIGS to the repository's configs/")
    return path


def model_shape(name: str):
    path = configs_dir() / "models" / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in (configs_dir() / "models").glob("*.json"))
        raise LithosError(f"unknown model shape {name!r}; known: {', '.join(known)}")
    hf = json.loads(path.read_text())
    return family_for_architecture(hf["architectures"][0]).config_from_hf(hf)


# Packed formats of --weight-format: those lithos quantizes to, and the GGUF ones it reads but does not make.
MADE_FORMATS = ("mxfp4", "mxfp8", "fp8_block128")
READ_FORMATS = (
    *("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs"),
    *("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "k_mix"),
)
# Mixes as GGUF files hold them: Q4_K_M's (Q3_K_M's, Q5_K_M's) V and down projections (a mixture of experts': its
# experts' and dense layers' down projections) in another K-quant in some layers than in others (K_MIX), the rest in
# Q4_K (Q3_K, Q5_K).
MIXED_IN_K_M = ("layers.wv", "layers.w_down", "experts.down", "dense.w_down", "shared.w_down")
READ_MIXES = {f"{main}_m": (main, dict.fromkeys(MIXED_IN_K_M, "k_mix")) for main in ("q3_k", "q4_k", "q5_k")}


SHAPE_SEED = 0


def shape_model(name: str, dtype) -> tuple[Any, Any]:
    """(config, params) of the named shape with random weights in `dtype`: one key for every bench, so
    every tool that times a shape times the same weights."""
    cfg = model_shape(name)
    return cfg, jax.jit(shape_init(cfg, dtype))(jax.random.key(SHAPE_SEED))


def shape_init(cfg, dtype):
    """The shape's random initialisation as a function of the key, always run jitted: XLA's rounding of the
    initialisers differs from op-by-op's, and `random_packed_init` prunes a jitted one."""
    return partial(family_for_architecture(cfg.architecture).init_params, cfg, dtype=dtype)


def shape_model_as_asked(name: str, dtype, args) -> tuple[str, Any, Any]:
    """(label, config, params) of a `--shape` run: `shape_model`, quantized to `--weight-format` (for
    `--quantize-groups`) when one is given, the format then in the label."""
    if args.weight_format in MADE_FORMATS or not args.weight_format:
        cfg, params = shape_model(name, dtype)
        if args.weight_format:
            params = quantize_params(params, args.weight_format, args.quantize_groups.split(","))
    else:  # read, not made: random codes at the weights' spread (speed does not depend on them)
        cfg = model_shape(name)
        init = shape_init(cfg, dtype)
        main, special = READ_MIXES.get(args.weight_format, (args.weight_format, {}))
        names = names_for_groups(args.quantize_groups.split(","), cfg.tie_word_embeddings)
        params = random_packed_init(init, jax.random.key(SHAPE_SEED), {name: special.get(name, main) for name in names})
    if args.weight_format:
        name = f"{name}-{args.weight_format}"
    return name, cfg, params


def hardware_profile(name: str | None) -> dict[str, Any]:
    """The profile named, or the one whose `match` strings appear in this device's kind."""
    profiles = {p.stem: json.loads(p.read_text()) for p in (configs_dir() / "hardware").glob("*.json")}
    if name:
        if name not in profiles:
            raise LithosError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(profiles))}")
        return {"id": name, **profiles[name]}
    kind = jax.devices()[0].device_kind if jax.default_backend() != "cpu" else "cpu"
    for pid, p in profiles.items():
        if any(m.lower() in kind.lower() for m in p.get("match", [])):
            return {"id": pid, **p}
    return {"id": "unknown", "name": kind, "price_per_gpu_hour": None, "gpus": 1}


def weight_bytes_read(params, cfg) -> int:
    """Bytes a decode step reads: every weight, except that an untied embedding table gives one row.

    Packed weights (lithos.quant) count their stored planes (codes, scales, mins): the bytes a kernel
    that reads the packed format moves. Mixture-of-experts families count only the experts one token
    is routed to (their `unread_weight_bytes`: top-k of each MoE layer's experts).
    """
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params))
    if params.lm_head is not None:
        embed_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params.embed))
        total -= embed_bytes - embed_bytes // params.embed.shape[0]
    unread = getattr(family_for_architecture(cfg.architecture), "unread_weight_bytes", None)
    if unread is not None:
        total -= unread(params, cfg)
    return int(total)


def kv_cache_bytes_read(cfg, context: int, kv_dtype) -> int:
    """KV bytes a one-token step reads from a cache of `kv_dtype` (lithos.kv_cache.cache_dtype): an FP8
    cache reads one byte per element plus its f32 scales (one per layer and KV head, for K and for V)."""
    if is_fp8(kv_dtype):
        return kv_bytes_read(cfg, context, 1) + 2 * cfg.num_layers * cfg.num_kv_heads * 4
    return kv_bytes_read(cfg, context, jnp.dtype(kv_dtype).itemsize)


def kv_bytes_read(cfg, context: int, itemsize: int) -> int:
    """Keys and values a one-token step reads at `context`; a family with sliding-window layers says
    how many positions those read (`kv_positions_read`)."""
    positions = getattr(family_for_architecture(cfg.architecture), "kv_positions_read", None)
    layer_positions = cfg.num_layers * context if positions is None else positions(cfg, context)
    return 2 * layer_positions * cfg.num_kv_heads * cfg.head_dim * itemsize


def decode_state(cache, context: int) -> decode.DecodeState:
    """The timed loops' state: one sequence at position `context` of `cache`, greedy, never finishing."""
    return decode.DecodeState(
        cache=cache,
        last_token=jnp.zeros((1,), jnp.int32),
        position=jnp.full((1,), context, jnp.int32),
        generated=jnp.zeros((1,), jnp.int32),
        limit=jnp.full((1,), 1 << 30, jnp.int32),
        finish=jnp.zeros((1,), jnp.int32),
        rng=jax.random.key(0),
        stop_ids=jnp.full((1,), -1, jnp.int32),
        sampling=SamplingParams.make(),
    )


@partial(jax.jit, static_argnames=("cfg", "steps", "kernels", "placement", "unroll"), donate_argnames=("state",))
def _steps(params, state, cfg, steps: int, kernels: str, placement=None, unroll: int = 1):
    def one(_, s):
        s, _tok = decode.decode_step(params, s, cfg, True, kernels, placement)
        return s

    return jax.lax.fori_loop(0, steps, one, state, unroll=unroll)


def time_decode_steps(
    params,
    cfg,
    context: int,
    kernels: str,
    steps: int,
    runs: int,
    placement=None,
    kv_cache_dtype=None,
    unroll: int = 1,
    loops: int = 1,
) -> list[float]:
    """Per-step ms of `runs` timed runs at `context` tokens, each `loops` device-side loops of `steps`
    greedy decode steps dispatched back to back and waited for once: a dispatch's fixed cost (0.4-0.9
    ms on an H200, NOTES.md run 68) is counted once per run, not once per `steps`. With `placement`,
    params already placed by it and the cache split the same way; the cache holds `kv_cache_dtype`
    (lithos.kv_cache.cache_dtype; default the weights' dtype). `unroll` steps run per loop iteration
    (benchmarks/probes/step_overhead.py times the loop's own cost with it)."""
    dtype = cache_dtype(kv_cache_dtype, params.embed.dtype)
    # A model whose every layer is windowed decodes from its ring, as lithos.Model does (lithos.kv_cache).
    window = family_for_architecture(cfg.architecture).cache_window(cfg)
    if placement is not None:
        placement = dataclasses.replace(placement, ring=ring_for(context + loops * steps, window))
        cache = placement.init_cache(1, context + loops * steps, dtype)
    else:
        cache = init_model_cache(cfg, 1, context + loops * steps, dtype)
    if cache.quantized:
        # No prefill sets this cache's scales: scales of 1 stand in (step time does not depend on values).
        cache = cache.replace(k_scale=jnp.ones_like(cache.k_scale), v_scale=jnp.ones_like(cache.v_scale))

    def start():  # a fresh array each run: the state (and everything in it) is donated
        return jnp.full((1,), context, jnp.int32)

    state = decode_state(cache, context)
    state = _steps(params, state, cfg, steps, kernels, placement, unroll)  # compile and warm up
    jax.block_until_ready(state)
    per_step = []
    for _ in range(runs):
        state = state.replace(position=start(), finish=jnp.zeros((1,), jnp.int32))
        t = time.perf_counter()
        for _ in range(loops):
            state = _steps(params, state, cfg, steps, kernels, placement, unroll)
        jax.block_until_ready(state)
        per_step.append((time.perf_counter() - t) * 1e3 / (loops * steps))
    return per_step


def cost_per_million_tokens(tokens_per_s: float, profile: dict[str, Any]) -> float | None:
    price = profile.get("price_per_gpu_hour")
    if not price or tokens_per_s <= 0:
        return None
    return profile.get("gpus", 1) * price / (tokens_per_s * 3600) * 1e6


@dataclasses.dataclass(frozen=True)
class LoopTiming:
    """How `lithos bench` times a path: `runs` timed runs of `loops` device loops of `steps` steps each,
    dispatched back to back (time_decode_steps); the step time is the median over the runs."""

    steps: int = 32
    loops: int = 4
    runs: int = 4

    def __post_init__(self):
        if min(self.steps, self.loops, self.runs) < 1 or self.steps * self.loops * self.runs < 128:
            raise LithosError(
                f"steps x loops x runs must be at least 128 (BENCHMARKS.md), each at least 1; got {self.steps} x "
                f"{self.loops} x {self.runs}"
            )

    def describe(self) -> str:
        if self.loops == 1:
            return f"median of {self.runs} timed runs, each one device loop of {self.steps} steps"
        return (
            f"median of {self.runs} timed runs, each {self.loops} device loops of {self.steps} steps dispatched "
            "back to back and waited for once"
        )


def bench_model(
    name: str,
    cfg,
    params,
    contexts,
    kernel_paths,
    timing: LoopTiming,
    bandwidth,
    profile,
    placement=None,
    overlap=False,
    kv_caches=("model",),
) -> list[dict[str, Any]]:
    """Rows for each KV cache kind (`kv_caches`: lithos.kv_cache.CACHE_DTYPES; an FP8 cache's rows are named
    `<name>-kvfp8`), context and kernel path; with `overlap` (and a placement), the fused path is
    timed a second time with its reductions overlapped (kernels "fused+overlap"), side by side."""
    rows = []
    for kv_cache in kv_caches:
        kv_dtype = cache_dtype(kv_cache, params.embed.dtype)
        if placement is not None and is_fp8(kv_dtype):
            placement = dataclasses.replace(placement, fp8_cache=True)
        label = f"{name}-kvfp8" if is_fp8(kv_dtype) else name
        rows += _bench_rows(
            label, cfg, params, contexts, kernel_paths, timing, bandwidth, profile, placement, overlap, kv_dtype
        )
    return rows


def _bench_rows(
    name, cfg, params, contexts, kernel_paths, timing: LoopTiming, bandwidth, profile, placement, overlap, kv_dtype
) -> list[dict[str, Any]]:
    """`bench_model`'s rows for one KV cache dtype (resolved: lithos.kv_cache.cache_dtype)."""
    rows = []
    wbytes = weight_bytes_read(params, cfg)
    variants = [(kernels, kernels, placement) for kernels in kernel_paths]
    if overlap and placement is not None and "fused" in kernel_paths:
        variants.append(("fused+overlap", "fused", dataclasses.replace(placement, overlap=True)))
    # Each path's weights as it reads them (the same values; on CUDA the megakernel's MXFP4 groups in tiles).
    laid_out = {kernels: params_for_kernels(params, cfg, kernels) for kernels in kernel_paths}
    for context in contexts:
        for label, kernels, where in variants:
            per_step = time_decode_steps(
                laid_out[kernels], cfg, context, kernels, timing.steps, timing.runs, where, kv_dtype, loops=timing.loops
            )
            step_ms = statistics.median(per_step)
            kv = kv_cache_bytes_read(cfg, context, kv_dtype)
            floor_ms = (wbytes + kv) / bandwidth * 1e3
            tps = 1e3 / step_ms
            rows.append(
                {
                    "model": name,
                    "dtype": str(params.embed.dtype),
                    "weight_formats": bytes_by_format(laid_out[kernels]),
                    "kv_cache": kv_dtype if is_fp8(kv_dtype) else jnp.dtype(kv_dtype).name,
                    "kernels": label,
                    "tp": 1 if where is None else where.tp,
                    "context": context,
                    "weight_bytes": wbytes,
                    "kv_bytes": kv,
                    "floor_ms": floor_ms,
                    "step_ms": step_ms,
                    "step_ms_runs": per_step,
                    "steps_timed": timing.steps * timing.loops * timing.runs,
                    "ratio_to_floor": step_ms / floor_ms,
                    "tokens_per_s": tps,
                    "cost_per_million_tokens": cost_per_million_tokens(tps, profile),
                }
            )
            print(f"  {name} {label} ctx={context}: {step_ms:.3f} ms/step (floor {floor_ms:.3f})", flush=True)
    return rows


def bench_generation(model, max_new_tokens: int) -> dict[str, Any]:
    """End-to-end greedy generation with real weights: what a user of `generate` sees."""
    model.generate(GENERATION_PROMPT, max_new_tokens=max_new_tokens)  # compile
    result = model.generate(GENERATION_PROMPT, max_new_tokens=max_new_tokens)
    return {
        "prompt": GENERATION_PROMPT,
        "prompt_tokens": result.prompt_tokens,
        "generated_tokens": result.generated_tokens,
        "prefill_ms": result.prefill_ms,
        "decode_ms": result.decode_ms,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "kernels": model.kernels,
        "text": result.text,
    }


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    # A run from a tree with uncommitted edits says so: the commit alone would not reproduce it.
    return (commit + ("+uncommitted" if changes.stdout.strip() else "")) or None


SOURCE_SUFFIXES = (".py", ".cu", ".h", ".json")


def source_digest(package: Path = REPO / "lithos") -> str:
    """SHA-256 over the package's sources (kernels, Python, tuning tables), path by path: what a run executed,
    whatever the git metadata beside it says (a copied tree may carry a stale `.git`, or none)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment() -> dict[str, Any]:
    dev = jax.devices()[0]
    import lithos

    return {
        "lithos": lithos.__version__,
        "lithos_commit": _git_commit(),
        "lithos_source_sha256": source_digest(),
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or __import__("jaxlib").__version__,
        "python": platform.python_version(),
        "host": platform.machine(),
        # A build variant (lithos/custom_calls/build.py) is part of what was measured.
        "kernel_defines": os.environ.get("LITHOS_KERNEL_DEFINES", "").split(),
        # So are the other knobs read from the environment (a weight layout, the tuning table, ...).
        "lithos_environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("LITHOS_")},
    }


def write_probe_record(out: str | Path, tag: str, script: str, protocol: str, rows: list, **extra: Any) -> Path:
    """A probe's record (benchmarks/probes): the date, device, command (`script` and its arguments),
    environment, protocol, rows and `extra` fields, as `<date>-<hardware>-<tag>.json` under `out`."""
    now = dt.datetime.now(dt.timezone.utc)
    record = {
        "date": now.isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "command": " ".join([f"python3 {script}", *sys.argv[1:]]),
        "environment": environment(),
        "protocol": protocol,
        "rows": rows,
        **extra,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{now:%Y-%m-%d}-{hardware_profile(None)['id']}-{tag}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def print_table(rows: list[dict[str, Any]], bandwidth: float) -> None:
    print(f"\nread bandwidth {bandwidth / 1e12:.3f} TB/s (measured)")
    header = (
        f"{'model':<28}{'kernels':<15}{'context':>8}{'floor ms':>10}{'step ms':>10}"
        f"{'x floor':>9}{'tok/s':>10}{'$/Mtok':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        cost = r["cost_per_million_tokens"]
        print(
            f"{r['model']:<28}{r['kernels']:<15}{r['context']:>8}{r['floor_ms']:>10.3f}{r['step_ms']:>10.3f}"
            f"{r['ratio_to_floor']:>9.2f}{r['tokens_per_s']:>10.1f}{'-' if cost is None else f'{cost:.3f}':>9}"
        )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        floor = sorted({(r["context"], r["floor_ms"]) for r in mine})
        ax.plot(*zip(*floor), "k--", lw=1, label=f"{model} floor")
        for kernels in sorted({r["kernels"] for r in mine}):
            pts = sorted((r["context"], r["step_ms"]) for r in mine if r["kernels"] == kernels)
            ax.plot(*zip(*pts), "o-", label=f"{model} {kernels}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_weight_format_arguments(p: argparse.ArgumentParser) -> None:
    """`--weight-format` and `--quantize-groups`, which `shape_model_as_asked` reads."""
    p.add_argument(
        "--weight-format",
        choices=(*MADE_FORMATS, *READ_FORMATS, *READ_MIXES),
        help="the --shape weights in this packed format (lithos.quant): quantized from the random weights, or for the "
        "GGUF formats, which lithos reads but does not make, random codes at their spread",
    )
    p.add_argument(
        "--quantize-groups", default="attention,mlp", help="tensor groups --weight-format applies to (attention,mlp)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", action="append", help="model shape from configs/models (repeatable); random weights")
    p.add_argument("--model", help="real checkpoint to time (default when no --shape: SmolLM2-135M-Instruct)")
    p.add_argument("--context", default="1024", help="comma-separated context lengths, e.g. 1024,8192,131072")
    p.add_argument("--kernels", default="reference", help="comma-separated kernel paths, e.g. reference,fused")
    p.add_argument("--dtype", default=None, help="weight dtype (default: bf16 on GPU, f32 on CPU)")
    add_weight_format_arguments(p)
    p.add_argument(
        "--dequantize", action="store_true", help="load --model's packed weights (GGUF Q4/Q8, ...) as dense dtype"
    )
    p.add_argument("--tp", type=int, default=1, help="split --shape models over this many devices (tensor parallel)")
    p.add_argument(
        "--tp-overlap",
        action="store_true",
        help="with --tp > 1: also time the fused path with its reductions overlapped (collective matmul)",
    )
    p.add_argument(
        "--kv-cache",
        default="model",
        help=f"comma-separated KV cache kinds to time side by side ({', '.join(CACHE_DTYPES)}), e.g. model,fp8",
    )
    p.add_argument("--steps", type=int, default=32, help="decode steps per device loop (the engine's chunk)")
    p.add_argument(
        "--loops", type=int, default=4, help="device loops per timed run, dispatched back to back, one wait at the end"
    )
    p.add_argument("--runs", type=int, default=4, help="timed runs (steps x loops x runs >= 128)")
    p.add_argument(
        "--generate-tokens", type=int, default=128, help="tokens for the end-to-end generation (real models)"
    )
    p.add_argument("--hardware", help="hardware profile from configs/hardware (default: detected)")
    p.add_argument(
        "--bandwidth-bytes", type=int, default=None, help="size of the bandwidth probe (default 4 GiB GPU, 512 MiB CPU)"
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="directory for the JSON and PNG")
    p.add_argument("--tag", default="", help="suffix for the result file name")
    from lithos.spec import bench as spec_bench

    spec_bench.add_arguments(p)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    timing = LoopTiming(args.steps, args.loops, args.runs)
    contexts = [int(c) for c in str(args.context).split(",")]
    kernel_paths = [k.strip() for k in str(args.kernels).split(",")]
    kv_caches = [k.strip() for k in str(args.kv_cache).split(",")]
    for kv in kv_caches:
        cache_dtype(kv, jnp.float32)  # an unknown name fails here, before anything is timed
    if args.tp_overlap and (args.tp < 2 or "fused" not in kernel_paths or not args.shape):
        raise LithosError(
            "--tp-overlap times the fused path's reductions between devices: give --shape, --tp 2 (or more) and "
            "--kernels with fused in it"
        )
    from lithos.checkpoint import default_dtype

    dtype_name = args.dtype or default_dtype()
    dtype = jnp.dtype(dtype_name)
    on_cpu = jax.default_backend() == "cpu"
    profile = hardware_profile(args.hardware)
    probe = args.bandwidth_bytes or ((512 << 20) if on_cpu else (4 << 30))
    bandwidth = measure_read_bandwidth(probe)
    print(f"device {jax.devices()[0].device_kind}: read bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)

    rows: list[dict[str, Any]] = []
    generation = None
    for shape in args.shape or []:
        shape, cfg, params = shape_model_as_asked(shape, dtype, args)
        placement = None
        if args.tp > 1:
            from lithos.placement import make_placement

            # Bytes per step stay the whole model's; the floor uses one GPU's bandwidth, so a
            # perfect split over tp GPUs would reach ratio_to_floor = 1/tp.
            placement = make_placement(cfg, args.tp)
            params, cfg, shape = placement.put_params(params), placement.cfg, f"{shape}-tp{args.tp}"
        timed = (contexts, kernel_paths, timing, bandwidth, profile, placement, args.tp_overlap, kv_caches)
        rows += bench_model(shape, cfg, params, *timed)
        del params
    if args.model or not args.shape:
        import lithos

        max_len = max(2048, max(contexts) + timing.loops * timing.steps)
        model = lithos.load(args.model, dtype=dtype_name, max_len=max_len, dequantize=args.dequantize)
        name = Path(model.checkpoint.source).stem
        rows += bench_model(
            name,
            model.cfg,
            model.params,
            contexts,
            kernel_paths,
            timing,
            bandwidth,
            profile,
            kv_caches=kv_caches,
        )
        generation = []
        for kv in kv_caches:
            for kernels in kernel_paths:
                runner = lithos.Model(model.checkpoint, max_len=model.max_len, kernels=kernels, kv_cache_dtype=kv)
                generation.append({**bench_generation(runner, args.generate_tokens), "kv_cache": kv})

    now = dt.datetime.now(dt.timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds"),
        "command": "lithos bench " + " ".join(argv if argv is not None else sys.argv[2:]),
        "environment": environment(),
        "hardware_profile": profile,
        "read_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_probe_bytes": probe,
        "bandwidth_probe": PROBE_METHOD,
        "protocol": f"batch 1, greedy, {timing.describe()}",
        "rows": rows,
        "generation": generation,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y-%m-%d}-{profile['id']}{'-' + args.tag if args.tag else ''}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / f"{stem}.png", f"lithos decode step, {profile.get('name', profile['id'])}")
    print_table(rows, bandwidth)
    if generation:
        for g in generation:
            print(
                f"generation ({g['kernels']}, KV cache {g['kv_cache']}): prompt {g['prompt_tokens']} tokens, "
                f"{g['generated_tokens']} generated, "
                f"prefill {g['prefill_ms']:.1f} ms, decode {g['decode_tokens_per_s']:.1f} tokens/s"
            )
    print(f"wrote {out / (stem + '.json')}")
    return result


def main(args: argparse.Namespace) -> int:
    if getattr(args, "spec", None):  # speculative decoding: acceptance and round time (lithos/spec/bench.py)
        from lithos.spec import bench as spec_bench

        spec_bench.run(args)
        return 0
    run(args)
    return 0
