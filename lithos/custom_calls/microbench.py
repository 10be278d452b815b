"""Time each fused op against its floor (bytes it must read / measured read bandwidth), beside its
reference twin, for the decode shapes. One op's time is measured over a chain of calls, one per
layer (so the bytes exceed L2 as in a real step), each feeding the next, inside a jitted fori_loop.

    python -m lithos.custom_calls.microbench --model llama-3.2-1b --tokens 1 --context 1024 131072

The per-call time includes each call's launch gap inside XLA's loop (what a decode step pays).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lithos.bandwidth import measure_read_bandwidth
from lithos.custom_calls import decode_attention, gate_up_silu, lm_head_argmax, matvec, qkv_rope_append
from lithos.custom_calls.step_shape import StepShape
from lithos.errors import LithosError

BF16 = jnp.bfloat16


def median_seconds(fn: Callable, *args, runs: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chain_seconds(step: Callable, weights: dict, state, layers: int, iters: int) -> float:
    """Seconds per call of `state = step(weights, state, layer)`, run for every layer, `iters` times.
    Weights travel as arguments: captured as constants they would be copied into the program."""

    def body(w, s):
        for layer in range(layers):
            s = step(w, s, layer)
        return s

    run = jax.jit(lambda w, s: jax.lax.fori_loop(0, iters, lambda _, s: body(w, s), s))
    return median_seconds(run, weights, state) / (iters * layers)


def random_weights(s: StepShape, tokens: int, context: int) -> dict[str, jax.Array]:
    k = iter(jax.random.split(jax.random.PRNGKey(1), 16))
    L, D, F, Dq, Dkv = s.layers, s.hidden, s.ffn, s.heads * s.head_dim, s.kv_heads * s.head_dim

    def rand(*shape, scale=1.0):
        return (scale * jax.random.normal(next(k), shape, jnp.float32)).astype(BF16)

    return dict(
        wo=rand(L, D, Dq, scale=Dq**-0.5),
        w_down=rand(L, D, F, scale=F**-0.5),
        w_gate=rand(L, F, D, scale=D**-0.5),
        w_up=rand(L, F, D, scale=D**-0.5),
        wq=rand(L, Dq, D, scale=D**-0.5),
        wk=rand(L, Dkv, D, scale=D**-0.5),
        wv=rand(L, Dkv, D, scale=D**-0.5),
        norm=1 + rand(L, D, scale=0.1),
        head=rand(s.vocab, D),
        k_cache=rand(L, 1, s.kv_heads, context + 16, s.head_dim),
        v_cache=rand(L, 1, s.kv_heads, context + 16, s.head_dim),
        inv_freq=jnp.asarray(1.0 / 5e5 ** (np.arange(0, s.head_dim, 2) / s.head_dim), jnp.float32),
        positions=jnp.arange(context - tokens, context, dtype=jnp.int32),
        h=rand(tokens, D),
        q=rand(tokens, s.heads, s.head_dim),
    )


def op_chains(s: StepShape, tokens: int, context: int, path: str) -> dict[str, tuple[Callable, str, int, int]]:
    """name -> (step, weights entry that starts the chain, layers in the chain, bytes one call reads).

    Each call's input is the previous call's output, so neither path can hoist work out of the loop;
    queries and attention outputs stand in for hidden states, so q_size must equal hidden."""
    if s.q_size != s.hidden:
        raise LithosError(f"the microbench chains attention outputs into hidden states: {s} has q_size {s.q_size}")
    L, D, F, Dq, Dkv = s.layers, s.hidden, s.ffn, s.q_size, s.kv_heads * s.head_dim

    def qkv(w, state, layer):
        x, kc, vc = state
        q_out, kc, vc = qkv_rope_append(
            x,
            w["norm"],
            w["wq"],
            w["wk"],
            w["wv"],
            w["inv_freq"],
            w["positions"],
            kc,
            vc,
            layer=layer,
            path=path,
        )
        return q_out.reshape(tokens, D), kc, vc

    def attention(w, x, layer):
        return decode_attention(x, w["k_cache"], w["v_cache"], w["positions"], layer=layer, path=path)

    def o_proj(w, x, layer):
        return matvec(x, w["wo"], layer=layer, residual=x, path=path)

    def mlp(w, x, layer):  # gate/up with the norm, then down with the residual
        gated = gate_up_silu(x, w["w_gate"], w["w_up"], layer=layer, norm_weight=w["norm"], path=path)
        return matvec(gated, w["w_down"], layer=layer, residual=x, path=path)

    def lm_head(w, ids, _):  # the embedding gather of the next step
        return lm_head_argmax(w["head"][ids], w["head"], norm_weight=w["norm"][0], path=path)

    b = 2  # bytes per bf16
    return {
        "qkv_rope_append": (qkv, "qkv_state", L, (Dq + 2 * Dkv) * D * b),
        f"attention@{context}": (attention, "q", L, 2 * s.kv_heads * context * s.head_dim * b),
        "o_proj+residual": (o_proj, "h", L, D * Dq * b),
        "mlp (gate_up+down)": (mlp, "h", L, 3 * F * D * b),
        "lm_head_argmax": (lm_head, "ids", 4, s.vocab * D * b),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", help="model shape from configs/models (repeatable)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, nargs="+", default=[1024])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--paths", nargs="+", default=["ffi", "reference"], choices=["ffi", "reference"])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "microbench.json"))
    args = parser.parse_args(argv)

    bandwidth = measure_read_bandwidth(4 << 30)
    print(f"device: {jax.devices()[0].device_kind}; read bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    paths = args.paths
    for model in args.model or ["llama-3.2-1b"]:
        shape = StepShape.named(model, "the microbench")
        for tokens in args.tokens:
            for i, context in enumerate(args.context):
                weights = random_weights(shape, tokens, context)
                starts = dict(h=weights["h"], q=weights["q"], ids=jnp.zeros((tokens,), jnp.int32),
                              qkv_state=(weights["h"], weights["k_cache"], weights["v_cache"]))  # fmt: skip
                chains = {p: op_chains(shape, tokens, context, p) for p in paths}
                for name, (_, _, _, nbytes) in chains[paths[0]].items():
                    if i > 0 and not name.startswith("attention"):
                        continue  # only attention depends on the context
                    row = dict(model=model, tokens=tokens, op=name, bytes=nbytes,
                               floor_us=nbytes / bandwidth * 1e6)  # fmt: skip
                    for p in paths:
                        step, start, layers, _ = chains[p][name]
                        row[f"{p}_us"] = chain_seconds(step, weights, starts[start], layers, args.iters) * 1e6
                    row["ratio"] = row[f"{paths[0]}_us"] / row["floor_us"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, read_bandwidth=bandwidth,
                       rows=rows), f, indent=1)  # fmt: skip
    print(f"\n{'model':14s} {'T':>2s} {'op':22s} {'MB':>8s} {'floor us':>9s} "
          + " ".join(f"{p + ' us':>12s}" for p in paths) + f" {'x floor':>7s}")  # fmt: skip
    for r in rows:
        times = " ".join(f"{r[p + '_us']:12.1f}" for p in paths)
        print(f"{r['model']:14s} {r['tokens']:2d} {r['op']:22s} {r['bytes'] / 1e6:8.2f} {r['floor_us']:9.1f} "
              f"{times} {r['ratio']:7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
