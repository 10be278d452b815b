"""The bandwidth probe reads its data once per loop iteration, on the device (lithos.bandwidth)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.bandwidth import _looped, measure_read_bandwidth


def _computations(hlo: str) -> dict[str, str]:
    """Optimised HLO text split into its computations, by name."""
    found = {}
    for block in hlo.split("\n\n"):
        m = re.search(r"^(?:ENTRY )?%([\w.\-]+) \(", block, re.M)
        if m:
            found[m.group(1)] = block
    return found


def _reduces_inside_loop(hlo: str, operand: str) -> bool:
    """Whether a reduce of an `operand`-shaped array runs in (or under) a while loop's body."""
    computations = _computations(hlo)
    pending = re.findall(r"while\(.*?body=%([\w.\-]+)", hlo)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        pending += re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", computations[name])
    return any(" reduce(" in computations[n] and operand in computations[n] for n in seen)


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_looped_reduction_sums_every_iteration(axis):
    x = jnp.arange(1 << 12, dtype=jnp.float32).reshape(64, 64)
    run = _looped(lambda a: jnp.sum(a, axis=axis))
    for n in (1, 3):
        np.testing.assert_allclose(float(run(x, jnp.int32(n))), n * float(jnp.sum(x)), rtol=1e-6)


def test_the_reduction_is_not_hoisted_out_of_the_loop():
    """XLA moves a loop-invariant reduction out of a loop; the probe's barrier keeps it in (a probe
    whose reduction ran once would divide one reduction's time by the loop length)."""
    x = jnp.ones((1 << 20,), jnp.float32)

    def hoistable(a, n):
        return jax.lax.fori_loop(0, n, lambda i, t: t + jnp.sum(a), jnp.float32(0))

    probe_hlo = _looped(jnp.sum).lower(x, jnp.int32(3)).compile().as_text()
    plain_hlo = jax.jit(hoistable).lower(x, jnp.int32(3)).compile().as_text()
    assert _reduces_inside_loop(probe_hlo, "f32[1048576]")
    assert not _reduces_inside_loop(plain_hlo, "f32[1048576]")


def test_measure_read_bandwidth_is_a_rate():
    bandwidth = measure_read_bandwidth(1 << 22)
    assert np.isfinite(bandwidth) and bandwidth > 0
