"""`lithos tune`: the fused kernels' launch parameters chosen by measurement, per device and shape.

For each problem a model's decode step poses (QKV + RoPE + append, attention over the cache, O
projection, gate/up + SiLU, down projection, LM head), at each token count asked for, candidates from
the kernel's search space are timed the microbench way: a chain of calls, one per layer, each
feeding the next, inside a jitted `fori_loop`, median of repeated runs. A candidate counts only if
its output matches the reference twin's on the same inputs. Every trial goes to a JSON file under
benchmarks/results/; each problem's winner goes to the table launch.py reads at run time (kept only
when it beats the heuristic by more than the noise margin, else the entry says "heuristic").

    lithos tune --shape llama-3.2-1b --shape llama-3.1-8b --tokens 1,8

Search: coordinate descent from the heuristic (all parameters 0), one parameter at a time over its
values with the others held at the best so far, until a round changes nothing; `--search grid`
times the whole space instead. Random weights: speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls import launch as launch_table
from lithos.custom_calls.attention import decode_attention
from lithos.custom_calls.lm_head import lm_head_argmax
from lithos.custom_calls.matvec import gate_up_silu, matvec
from lithos.custom_calls.qkv import qkv_rope_append
from lithos.custom_calls.step_shape import StepShape
from lithos.errors import LithosError

REPO = Path(__file__).resolve().parents[2]
BF16 = jnp.bfloat16

# Values tried per launch parameter, in the order coordinate descent visits them; 0 is the kernel's
# heuristic (k_split by the 24-warps-per-SM rule, 8 warps per block, as many blocks per SM/CU as
# fit, about 4 attention blocks per SM/CU, 64 keys per split at least).
ROW_GROUP_SPACE: dict[str, tuple[int, ...]] = {
    "k_split": (0, 1, 2, 4, 8),
    "blocks_per_unit": (0, 1, 2, 4),
    "warps_per_block": (0, 4),
}
ATTENTION_SPACE: dict[str, tuple[int, ...]] = {
    "splits": (0, 4, 8, 16, 32, 64),  # most splits per KV head
    "split_keys": (0, 16, 32, 128, 256),  # fewest keys per split
}
SEARCH_SPACES = {
    kernel: ATTENTION_SPACE if kernel == "decode_attention" else ROW_GROUP_SPACE
    for kernel in launch_table.LAUNCH_PARAMS
}

# Roles: where in a decode step a problem comes from; the chain that times it (see _chain_step).
ROLES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head")
ROLE_KERNEL = {
    "qkv": "qkv_rope_append",
    "attention": "decode_attention",
    "o_proj": "matvec",
    "gate_up": "gate_up_silu",
    "down": "matvec",
    "lm_head": "lm_head_argmax",
}
# A candidate's output against the reference twin's: relative error in the 2-norm (bf16 outputs
# round at about 4e-3), and every greedy token equal.
MAX_RELATIVE_ERROR = 1e-2
LM_HEAD_CHAIN = 4  # the LM head runs once per step: a short chain of repeated calls


@dataclasses.dataclass(frozen=True)
class Problem:
    """One kernel call of a decode step, keyed as the table keys it."""

    role: str
    shape: StepShape
    tokens: int
    context: int

    @property
    def kernel(self) -> str:
        return ROLE_KERNEL[self.role]

    @property
    def cache_len(self) -> int:
        return self.context + 16  # room for the positions written, as the microbench has

    @property
    def dims(self) -> dict[str, int]:
        s = self.shape
        return {
            "qkv": {"hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim},
            "attention": {
                "heads": s.heads,
                "kv_heads": s.kv_heads,
                "head_dim": s.head_dim,
                "cache": launch_table.length_bucket(self.cache_len),
            },
            "o_proj": {"in": s.q_size, "out": s.hidden},
            "gate_up": {"in": s.hidden, "out": s.ffn},
            "down": {"in": s.ffn, "out": s.hidden},
            "lm_head": {"hidden": s.hidden, "vocab": s.vocab},
        }[self.role]

    @property
    def key(self) -> str:
        return launch_table.problem_key(self.kernel, self.dims, self.tokens)


def model_problems(
    shape: StepShape, tokens: Sequence[int], context: int, kernels: Sequence[str] | None = None
) -> list[Problem]:
    """The distinct problems of one model's decode step (a 1B model's O projection and a down
    projection of the same dims are one problem), for the kernels named (default: all)."""
    unknown = sorted(set(kernels or ()) - set(launch_table.LAUNCH_PARAMS))
    if unknown:
        raise LithosError(
            f"unknown kernel {', '.join(unknown)}; the tunable kernels are {', '.join(launch_table.LAUNCH_PARAMS)}"
        )
    problems: dict[str, Problem] = {}
    for t, role in itertools.product(tokens, ROLES):
        launch_table.token_bucket(t)  # 1..16, else an error that says so
        problem = Problem(role, shape, t, context)
        if (kernels is None or problem.kernel in kernels) and problem.key not in problems:
            problems[problem.key] = problem
    return list(problems.values())


def valid_launch(kernel: str, params: Mapping[str, int]) -> bool:
    """Whether the handler accepts `params` (csrc/rowdot.h check_launch): k_split <= warps per block."""
    if kernel == "decode_attention":
        return True
    warps = params.get("warps_per_block", 0) or 8
    return params.get("k_split", 0) <= warps


def search_space(kernel: str) -> list[dict[str, int]]:
    """Every valid candidate for `kernel`, the heuristic (all 0) first."""
    space = SEARCH_SPACES[kernel]
    grid = (dict(zip(space, values)) for values in itertools.product(*space.values()))
    return [params for params in grid if valid_launch(kernel, params)]


def coordinate_search(
    kernel: str,
    measure: Callable[[dict[str, int]], float | None],
    max_trials: int | None = None,
    rounds: int = 3,
) -> tuple[dict[str, int], float | None]:
    """Coordinate descent from the heuristic: each parameter in turn over its values, the others held
    at the best so far, until a round changes nothing. `measure(params)` is seconds, or None for a
    candidate that failed; each distinct candidate is measured once, at most `max_trials` of them.
    Returns the best candidate and its time."""
    space = SEARCH_SPACES[kernel]
    measured: dict[tuple, float | None] = {}

    def timed(params: dict[str, int]) -> float | None:
        key = tuple(sorted(params.items()))
        if key not in measured:
            if max_trials is not None and len(measured) >= max_trials:
                return None
            measured[key] = measure(params)
        return measured[key]

    best = {name: 0 for name in space}
    best_time = timed(best)
    for _ in range(rounds):
        changed = False
        for name, values in space.items():
            for value in values:
                candidate = best | {name: value}
                if not valid_launch(kernel, candidate):
                    continue
                t = timed(candidate)
                if t is not None and (best_time is None or t < best_time):
                    best, best_time, changed = candidate, t, True
        if not changed:
            break
    return best, best_time


def grid_search(
    kernel: str, measure: Callable[[dict[str, int]], float | None], max_trials: int | None = None
) -> tuple[dict[str, int], float | None]:
    """Every candidate of the search space (the first `max_trials`); the best and its time."""
    best, best_time = {}, None
    for params in search_space(kernel)[:max_trials]:
        t = measure(params)
        if t is not None and (best_time is None or t < best_time):
            best, best_time = params, t
    return best, best_time


# ---------------------------------------------------------------------------------------------
# Timing one candidate
# ---------------------------------------------------------------------------------------------


def random_inputs(s: StepShape, tokens: int, context: int, roles: set[str]) -> dict[str, jax.Array]:
    """Random bf16 weights `[layers, out, in]`, caches `[layers, 1, kv_heads, context + 16, head_dim]`
    and activations for the roles asked for (only what their chains read)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 24))
    L, D, F, Dq, Dkv = s.layers, s.hidden, s.ffn, s.q_size, s.kv_heads * s.head_dim

    def rand(*shape, scale=1.0):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(BF16)

    w: dict[str, jax.Array] = dict(
        norm=1 + rand(L, D, scale=0.1), h=rand(tokens, D), q=rand(tokens, s.heads, s.head_dim)
    )
    if roles & {"qkv", "attention"}:
        cache = (L, 1, s.kv_heads, context + 16, s.head_dim)
        w |= dict(k_cache=rand(*cache), v_cache=rand(*cache))
        w["positions"] = jnp.arange(context - tokens, context, dtype=jnp.int32)
    if "qkv" in roles:
        w |= dict(
            wq=rand(L, Dq, D, scale=D**-0.5), wk=rand(L, Dkv, D, scale=D**-0.5), wv=rand(L, Dkv, D, scale=D**-0.5)
        )
        w["inv_freq"] = jnp.asarray(1.0 / 5e5 ** (np.arange(0, s.head_dim, 2) / s.head_dim), jnp.float32)
    if roles & {"o_proj", "qkv"}:
        w["wo"] = rand(L, D, Dq, scale=Dq**-0.5)
    if roles & {"gate_up", "down"}:
        w |= dict(w_down=rand(L, D, F, scale=F**-0.5), gated=rand(tokens, F))
    if "gate_up" in roles:
        w |= dict(w_gate=rand(L, F, D, scale=D**-0.5), w_up=rand(L, F, D, scale=D**-0.5))
    if "lm_head" in roles:
        w["head"] = rand(s.vocab, D)
    return w


def chain_start(problem: Problem, w: dict[str, jax.Array]):
    """The state the problem's chain starts from."""
    return {
        "qkv": lambda: (w["h"], w["k_cache"], w["v_cache"]),
        "attention": lambda: w["q"],
        "o_proj": lambda: w["h"],
        "gate_up": lambda: w["h"],
        "down": lambda: w["h"],
        "lm_head": lambda: jnp.arange(problem.tokens, dtype=jnp.int32),
    }[problem.role]()


def chain_step(problem: Problem, launch: Mapping[str, int] | None, path: str) -> Callable:
    """`state = step(w, state, layer)`: one call of the problem's kernel with `launch`, its output
    feeding the next call, so no call can be hoisted out of the loop. Partner calls (the down
    projection after gate/up; the O projection after QKV where q_size != hidden) keep the heuristic."""
    T, s = problem.tokens, problem.shape
    heuristic: dict[str, int] = {}

    def qkv(w, state, layer):
        x, kc, vc = state
        q, kc, vc = qkv_rope_append(
            x, w["norm"], w["wq"], w["wk"], w["wv"], w["inv_freq"], w["positions"], kc, vc,
            layer=layer, path=path, launch=launch,
        )  # fmt: skip
        q = q.reshape(T, s.q_size)
        if s.q_size != s.hidden:
            q = matvec(q, w["wo"], layer=layer, residual=x, path=path, launch=heuristic)
        return q, kc, vc

    def attention(w, q, layer):
        return decode_attention(q, w["k_cache"], w["v_cache"], w["positions"], layer=layer, path=path, launch=launch)

    def o_proj(w, h, layer):  # the residual carries the chain; the attention output is fixed
        return matvec(w["q"].reshape(T, s.q_size), w["wo"], layer=layer, residual=h, path=path, launch=launch)

    def gate_up(w, h, layer):
        gated = gate_up_silu(h, w["w_gate"], w["w_up"], layer=layer, norm_weight=w["norm"], path=path, launch=launch)
        return matvec(gated, w["w_down"], layer=layer, residual=h, path=path, launch=heuristic)

    def down(w, h, layer):
        return matvec(w["gated"], w["w_down"], layer=layer, residual=h, path=path, launch=launch)

    def lm_head(w, ids, _):  # the next step's embedding gather feeds it
        return lm_head_argmax(w["head"][ids], w["head"], norm_weight=w["norm"][0], path=path, launch=launch)

    return dict(qkv=qkv, attention=attention, o_proj=o_proj, gate_up=gate_up, down=down, lm_head=lm_head)[problem.role]


def chain_layers(problem: Problem) -> int:
    return LM_HEAD_CHAIN if problem.role == "lm_head" else problem.shape.layers


def relative_error(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    if actual.shape != expected.shape or not np.isfinite(actual).all():
        return float("inf")
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def output_error(problem: Problem, out, ref, w: dict[str, jax.Array]) -> float:
    """How far one candidate call's output is from the reference twin's (0 = identical)."""
    if problem.role == "lm_head":
        return float(np.mean(np.asarray(out) != np.asarray(ref)))
    if problem.role == "qkv":  # q, and the cache slots written at layer 0
        slots = np.asarray(w["positions"])
        errors = [relative_error(out[0], ref[0])]
        errors += [relative_error(o[0, 0, :, slots], r[0, 0, :, slots]) for o, r in zip(out[1:], ref[1:])]
        return max(errors)
    return relative_error(out, ref)


@dataclasses.dataclass
class Trial:
    problem: str
    params: dict[str, int]
    us: float | None  # per call (per layer for chains); None when the check or the launch failed
    error: float | None  # against the reference twin
    note: str = ""


class ProblemTimer:
    """Times candidates of one problem on shared random inputs; keeps each compiled chain so a
    candidate can be timed again without compiling."""

    def __init__(self, problem: Problem, inputs: dict[str, jax.Array], iters: int, repeats: int):
        self.problem, self.w, self.iters, self.repeats = problem, inputs, iters, repeats
        self.start = chain_start(problem, inputs)
        check = jax.jit(lambda w, s: chain_step(problem, None, "reference")(w, s, 0))
        self.reference = jax.block_until_ready(check(inputs, self.start))
        self.runners: dict[tuple, Callable] = {}
        self.trials: list[Trial] = []

    def runner(self, params: Mapping[str, int]) -> Callable:
        key = tuple(sorted(params.items()))
        if key not in self.runners:
            step, layers = chain_step(self.problem, dict(params), "ffi"), chain_layers(self.problem)

            def body(w, s):
                for layer in range(layers):
                    s = step(w, s, layer)
                return s

            self.runners[key] = jax.jit(lambda w, s: jax.lax.fori_loop(0, self.iters, lambda _, s: body(w, s), s))
        return self.runners[key]

    def seconds(self, params: Mapping[str, int]) -> float:
        """Median over `repeats` runs, per call, after a warm-up run (which also compiles)."""
        run = self.runner(params)
        jax.block_until_ready(run(self.w, self.start))
        times = []
        for _ in range(self.repeats):
            begin = time.perf_counter()
            jax.block_until_ready(run(self.w, self.start))
            times.append(time.perf_counter() - begin)
        return statistics.median(times) / (self.iters * chain_layers(self.problem))

    def measure(self, params: dict[str, int], note: str = "") -> float | None:
        """Check one candidate against the reference twin, then time it; records the trial."""
        params = {k: int(v) for k, v in params.items()}
        try:
            check = jax.jit(lambda w, s: chain_step(self.problem, params, "ffi")(w, s, 0))
            error = output_error(self.problem, jax.block_until_ready(check(self.w, self.start)), self.reference, self.w)
        except Exception as e:  # a launch the handler rejects fails this candidate, not the run
            self.trials.append(Trial(self.problem.key, params, None, None, f"{note} failed: {e}"[:500].strip()))
            return None
        limit = 0.0 if self.problem.role == "lm_head" else MAX_RELATIVE_ERROR
        if not error <= limit:
            self.trials.append(
                Trial(self.problem.key, params, None, error, f"{note} rejected: error {error:.2e}".strip())
            )
            return None
        seconds = self.seconds(params)
        self.trials.append(Trial(self.problem.key, params, seconds * 1e6, error, note))
        return seconds


@dataclasses.dataclass
class Outcome:
    problem: Problem
    params: dict[str, int]  # the table entry's: only non-zero parameters; {} = the heuristic
    us: float  # the entry's time, from the confirmation runs
    heuristic_us: float
    candidates: int


def tune_problem(
    timer: ProblemTimer, search: str = "greedy", max_trials: int | None = None, min_gain: float = 0.02
) -> Outcome:
    """Search one problem, then time the best candidate and the heuristic again, alternately, and keep
    the candidate only if it beats the heuristic by more than `min_gain`."""
    kernel = timer.problem.kernel
    find = coordinate_search if search == "greedy" else grid_search
    best, best_time = find(kernel, timer.measure, max_trials)
    candidates = len(timer.trials)
    heuristic = {name: 0 for name in SEARCH_SPACES[kernel]}
    if best_time is None:
        raise LithosError(
            f"{timer.problem.key}: no candidate passed the check against the reference twin, the heuristic "
            f"included: run tests/test_custom_calls_gpu.py to find the broken kernel ({timer.trials[-1].note})"
        )
    best_us, heuristic_us = [], []
    for _ in range(2):  # alternate so drift hits both
        best_us.append(timer.seconds(best) * 1e6)
        heuristic_us.append(timer.seconds(heuristic) * 1e6)
    for params, times in ((best, best_us), (heuristic, heuristic_us)):
        timer.trials.append(Trial(timer.problem.key, params, min(times), None, "confirmation (best of 2)"))
    best_t, heuristic_t = min(best_us), min(heuristic_us)
    if best != heuristic and best_t < heuristic_t * (1 - min_gain):
        return Outcome(timer.problem, {k: v for k, v in best.items() if v}, best_t, heuristic_t, candidates)
    return Outcome(timer.problem, {}, heuristic_t, heuristic_t, candidates)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def require_gpu() -> str:
    from lithos.custom_calls.build import gpu_platform

    platform = gpu_platform()
    if platform is None:
        raise LithosError(
            f"lithos tune times the fused kernels on a GPU, and jax sees none (backend: {jax.default_backend()}): "
            "run it on the CUDA or ROCm machine the table is for, with jax's GPU plugin installed "
            "(pip install 'jax[cuda13]' or 'jax[rocm7-local]'); the table it writes "
            "(lithos/custom_calls/tuning/<device>.json) is read wherever that device runs"
        )
    return platform


def named_shapes(args: argparse.Namespace) -> dict[str, StepShape]:
    shapes = {name: StepShape.named(name, "lithos tune") for name in args.shape or []}
    if args.model:
        from lithos.checkpoint import load_checkpoint

        path = Path(args.model)
        if (path / "config.json").is_file():  # a HF directory: its config alone gives the shape
            from lithos.checkpoint.safetensors_dir import read_config
            from lithos.models import family_for_architecture

            hf = read_config(path)
            cfg = family_for_architecture(hf["architectures"][0]).config_from_hf(hf)
        else:
            cfg = load_checkpoint(path).cfg
        shapes[path.stem] = StepShape.from_config(cfg, "lithos tune")
    if not shapes:
        raise LithosError("give the shapes to tune: --shape NAME (from configs/models, repeatable) or --model PATH")
    return shapes


def parse_ints(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError as e:
        raise LithosError(f"--{what} takes comma-separated integers, e.g. 1,8; got {text!r}") from e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", action="append", help="model shape from configs/models (repeatable)")
    p.add_argument("--model", help="a checkpoint whose shape to tune (HF dir, .gguf, lithos-converted dir)")
    p.add_argument("--tokens", default="1", help="comma-separated query positions per step, e.g. 1,8 (1..16)")
    p.add_argument("--context", type=int, default=1024, help="context length for attention (cache = context + 16)")
    p.add_argument(
        "--kernels", default=",".join(launch_table.LAUNCH_PARAMS), help="comma-separated kernels to tune (default: all)"
    )
    p.add_argument("--trials", type=int, default=None, help="most candidates timed per problem (default: no limit)")
    p.add_argument(
        "--search", choices=("greedy", "grid"), default="greedy", help="coordinate descent or every candidate"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per candidate (the median is kept)")
    p.add_argument("--iters", type=int, default=10, help="fori_loop iterations per run (each one call per layer)")
    p.add_argument("--min-gain", type=float, default=0.02, help="a winner must beat the heuristic by this fraction")
    p.add_argument("--table", default=None, help="table file (default: lithos/custom_calls/tuning/<device>.json)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="directory for the trials JSON")
    p.add_argument("--dry-run", action="store_true", help="list the problems and the search space sizes, time nothing")


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    tokens = parse_ints(args.tokens, "tokens")
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    shapes = named_shapes(args)
    problems = {name: model_problems(shape, tokens, args.context, kernels) for name, shape in shapes.items()}
    if args.dry_run:
        for name, plist in problems.items():
            for problem in plist:
                print(f"{name:16s} {problem.key:60s} {len(search_space(problem.kernel)):4d} candidates")
        return {"problems": {name: [p.key for p in plist] for name, plist in problems.items()}}
    require_gpu()
    from lithos.bench import environment

    device_kind = launch_table.current_device_kind()
    table = Path(args.table) if args.table else launch_table.table_path(device_kind)
    now = dt.datetime.now(dt.timezone.utc)
    stem = (
        f"{now:%Y-%m-%d}-{launch_table.device_slug(device_kind)}-tune-{'-'.join(shapes)}-T{'-'.join(map(str, tokens))}"
    )
    trials_path = Path(args.out).resolve() / f"{stem}.json"

    outcomes: list[Outcome] = []
    trials: list[Trial] = []
    rel_trials = str(trials_path.relative_to(REPO)) if trials_path.is_relative_to(REPO) else trials_path.name
    result = {
        "date": now.isoformat(timespec="seconds"),
        "command": "lithos tune " + " ".join(argv if argv is not None else sys.argv[2:]),
        "environment": environment(),
        "method": (
            f"per candidate: one call checked against the reference twin (relative error <= {MAX_RELATIVE_ERROR}, "
            f"greedy tokens equal), then a chain of one call per layer in a jitted fori_loop of {args.iters} "
            f"iterations, median of {args.repeats} runs, per call; winners confirmed against the heuristic, best "
            f"of 2 alternating runs, kept when faster by more than {args.min_gain:.0%}"
        ),
        "search": args.search,
        "shapes": {name: dataclasses.asdict(s) for name, s in shapes.items()},
        "context": args.context,
        "table": str(table),
        "winners": {},
        "trials": [],
    }
    for name, shape in shapes.items():
        for t in tokens:
            todo = [p for p in problems[name] if p.tokens == t]
            if not todo:
                continue
            inputs = random_inputs(shape, t, args.context, {p.role for p in todo})
            for problem in todo:
                began = time.perf_counter()
                timer = ProblemTimer(problem, inputs, args.iters, args.repeats)
                outcome = tune_problem(timer, args.search, args.trials, args.min_gain)
                outcomes.append(outcome)
                trials += timer.trials
                entry = {
                    "params": outcome.params,
                    "us": round(outcome.us, 2),
                    "heuristic_us": round(outcome.heuristic_us, 2),
                    "trials": rel_trials,
                    "date": f"{now:%Y-%m-%d}",
                }
                # Written after every problem: a run stopped part way keeps what it measured.
                launch_table.write_table(table, device_kind, {problem.key: entry})
                result["winners"][problem.key] = entry
                result["trials"] = [dataclasses.asdict(trial) for trial in trials]
                trials_path.parent.mkdir(parents=True, exist_ok=True)
                trials_path.write_text(json.dumps(result, indent=1))
                print(
                    f"{name:14s} {problem.key:58s} heuristic {outcome.heuristic_us:8.1f} us  best {outcome.us:8.1f} "
                    f"us  {outcome.params or 'heuristic'}  ({outcome.candidates} candidates, "
                    f"{time.perf_counter() - began:.0f} s)",
                    flush=True,
                )
            del inputs

    print(f"\n{'problem':60s} {'heuristic us':>12s} {'tuned us':>9s} {'gain':>6s}  params")
    for o in outcomes:
        gain = 1 - o.us / o.heuristic_us
        print(f"{o.problem.key:60s} {o.heuristic_us:12.1f} {o.us:9.1f} {gain:6.1%}  {o.params or 'heuristic'}")
    print(f"wrote {len(trials)} trials to {trials_path} and {len(outcomes)} entries to {table}")
    return result


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lithos.custom_calls.tune", description=__doc__.split("\n")[0])
    add_arguments(parser)
    try:
        sys.exit(main(parser.parse_args()))
    except LithosError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
