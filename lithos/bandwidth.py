"""The floor's denominator: how many bytes per second this device's memory delivers to a reduction.

BENCHMARKS.md measures the floor against "a large on-device reduction" in the same run. Timing one
dispatch of it from the host adds the launch and the host's wake-up to a millisecond of reading: on
the H200 one call read 3.71 TB/s and another 4.11, while the megakernel's own LM head streamed at
4.46. So the reduction runs in a device-side loop, and the time of a short loop is subtracted from a
long one's: what is left is reading only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

PROBE_METHOD = "device loop of reductions; per-reduction time = (long loop - short loop) / extra reductions"
ROWS = 16384  # rows of the 2-D reduction layouts


def probe_array(nbytes: int) -> jax.Array:
    """float32 ones of about `nbytes`, rounded down to whole rows of both 2-D views (at least one)."""
    nbytes = max(nbytes // (4 * ROWS), 1) * 4 * ROWS
    return jnp.ones((nbytes // 4,), jnp.float32)


def reduction_layouts() -> list[Callable[[jax.Array], jax.Array]]:
    """The reductions timed: XLA's speed differs between layouts, and the floor should be what the
    memory can deliver, not what one layout reaches."""
    return [
        lambda a: jnp.sum(a),
        lambda a: jnp.sum(a.reshape(-1, ROWS), axis=0),
        lambda a: jnp.sum(a.reshape(ROWS, -1), axis=1),
    ]


def _looped(reduction: Callable[[jax.Array], jax.Array]):
    """`reduction(x)` repeated `n` times on the device, each repeat reading all of `x`."""

    def run(x: jax.Array, n: jax.Array) -> jax.Array:
        def body(_, total):
            # The barrier ties x to the loop's state, so XLA cannot hoist the loop-invariant reduction
            # out of the loop and time it once.
            data, total = jax.lax.optimization_barrier((x, total))
            return total + jnp.sum(reduction(data))

        return jax.lax.fori_loop(0, n, body, jnp.float32(0))

    return jax.jit(run)


def _best_seconds(run, x: jax.Array, n: int, repeats: int) -> float:
    count = jnp.int32(n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(x, count).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def measure_read_bandwidth(nbytes: int, repeats: int = 3, extra: int = 16) -> float:
    """Bytes/s of a reduction over `nbytes` of float32 (each byte read once per reduction).

    Per layout (`reduction_layouts`), the best of `repeats` loops of 1 and of 1 + `extra` reductions;
    their difference over `extra` is one reduction's device time. The best layout is kept.
    """
    x = probe_array(nbytes)
    best = float("inf")
    for reduction in reduction_layouts():
        run = _looped(reduction)
        run(x, jnp.int32(1)).block_until_ready()  # compile and warm up
        short = _best_seconds(run, x, 1, repeats)
        long = _best_seconds(run, x, 1 + extra, repeats)
        # On a small probe the host's noise can exceed the extra reductions' time; the long loop's
        # mean is then an upper bound on one reduction's time (a lower bound on the bandwidth).
        seconds = (long - short) / extra if long > short else long / (1 + extra)
        best = min(best, seconds)
    return x.nbytes / best
