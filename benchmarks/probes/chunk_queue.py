"""The engine's decode loop on a named shape: chunks of decode steps read back one by one, either each
dispatched after the previous one was read (lithos.engine on the fused path) or one chunk queued behind the one
being read (lithos.engine on the megakernel). Both run lithos.decode.decode_chunk as the engine calls it, with
the engine's chunk (32 steps) and block (4 by default), and read every chunk's tokens back to the host.

Runs 69-70 (H200, llama-3.2-1b): the two loops are within 5 us a token of each other at every block (4, 8,
16, 32), so the engine kept the plain loop. Both run at 0.99-1.00 ms a token on the megakernel and
1.17-1.19 on the fused path, against 0.943 and 1.123 ms a step in `lithos bench`'s loop. Run 73 found why:
the chunk's `while_loop` runs from the host, so the call returns only once the chunk has run, and a second
chunk cannot be queued behind it. Megakernel chunks now run a fixed length, so the engine queues them: run
78, 0.943 ms a token queued against 0.981 one by one (1B), and a step past the end costs 65 us.

    PYTHONPATH=. python3 benchmarks/probes/chunk_queue.py --shape llama-3.2-1b --kernels megakernel,fused

Prints a table and writes the JSON to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from lithos import bench, decode
from lithos.checkpoint import default_dtype
from lithos.models import init_model_cache


def decode_tokens(
    params, cfg, kernels: str, context: int, chunks: int, chunk: int, block: int, queued: bool, finished=False
):
    """ms per token of `chunks` chunks after `context` tokens, every chunk's tokens read back to the host;
    with `finished`, ms per step of a sequence that is already done (steps that produce nothing)."""
    state = bench.decode_state(init_model_cache(cfg, 1, context + (chunks + 1) * chunk, params.embed.dtype), context)
    if finished:
        state = state.replace(finish=jnp.full((1,), decode.STOPPED_AT_LIMIT, jnp.int32))

    def dispatch(state):
        return decode.decode_chunk(params, state, cfg=cfg, chunk=chunk, block=block, greedy=True, kernels=kernels)

    tokens = []
    t = time.perf_counter()
    if queued:
        ahead = dispatch(state)
        for i in range(chunks):
            state, out = ahead
            ahead = dispatch(state) if i + 1 < chunks else None
            tokens.append(np.asarray(out))
    else:
        for _ in range(chunks):
            state, out = dispatch(state)
            tokens.append(np.asarray(out))
    jax.block_until_ready(state)
    ms = (time.perf_counter() - t) * 1e3
    # Every step made a token, or (finished) none did.
    assert all(((chunk_tokens < 0) if finished else (chunk_tokens >= 0)).all() for chunk_tokens in tokens)
    return ms / (chunks * chunk), np.concatenate(tokens, axis=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", help="model shape from configs/models (repeatable)")
    p.add_argument("--kernels", default="megakernel,fused", help="comma-separated kernel paths")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunks", type=int, default=8, help="chunks per timed run")
    p.add_argument("--chunk", type=int, default=32, help="decode steps per chunk (the engine's stream_every)")
    p.add_argument("--block", type=int, default=4, help="steps between loop-condition checks (the engine's block)")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--out", default=str(bench.REPO / "benchmarks" / "results"))
    p.add_argument("--tag", default="chunk-queue")
    args = p.parse_args()

    dtype = jnp.dtype(default_dtype())
    rows = []
    for shape in args.shape or ["llama-3.2-1b"]:
        cfg, params = bench.shape_model(shape, dtype)
        for kernels in args.kernels.split(","):
            timed = (params, cfg, kernels, args.context, args.chunks, args.chunk, args.block)
            decode_tokens(*timed, queued=True)  # compile and warm up
            per_token = {False: [], True: []}
            seen = {}
            for _ in range(args.runs):  # alternating, so both loops see the same device state
                for queued in (False, True):
                    ms, seen[queued] = decode_tokens(*timed, queued=queued)
                    per_token[queued].append(ms)
            if not np.array_equal(seen[False], seen[True]):
                raise SystemExit(f"{shape} {kernels}: the queued loop decoded other tokens than the one-by-one loop")
            # What a step past the end costs: chunks of a sequence that is already done.
            empty = statistics.median(decode_tokens(*timed, queued=True, finished=True)[0] for _ in range(args.runs))
            for queued in (False, True):
                rows.append(
                    {
                        "model": shape,
                        "kernels": kernels,
                        "context": args.context,
                        "loop": "queued" if queued else "one by one",
                        "ms_per_token": statistics.median(per_token[queued]),
                        "ms_per_token_runs": per_token[queued],
                        "ms_per_finished_step": empty,
                    }
                )
                print(f"  {shape} {kernels} {rows[-1]['loop']}: {rows[-1]['ms_per_token']:.4f} ms/token", flush=True)
        del params

    protocol = (
        f"batch 1, greedy, random weights, {args.chunks} chunks of {args.chunk} steps (block {args.block}) read "
        f"back one by one, median of {args.runs} runs, the two loops alternating"
    )
    path = bench.write_probe_record(args.out, args.tag, "benchmarks/probes/chunk_queue.py", protocol, rows)
    print(f"{'model':<16}{'kernels':<12}{'one by one ms':>15}{'queued ms':>11}{'gain us/token':>15}{'finished us':>13}")
    for one, queued in zip(rows[::2], rows[1::2]):
        gain_us = (one["ms_per_token"] - queued["ms_per_token"]) * 1e3
        print(
            f"{one['model']:<16}{one['kernels']:<12}{one['ms_per_token']:>15.4f}{queued['ms_per_token']:>11.4f}"
            f"{gain_us:>15.2f}{one['ms_per_finished_step'] * 1e3:>13.1f}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
