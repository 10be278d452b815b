"""Three read-bandwidth probes in one call (run 35): lithos.bandwidth (a device-side loop of XLA
reductions), the host-timed single dispatch it replaced, and torch's sum timed with CUDA events.

    OUT=<dir> PYTHONPATH=. python3 benchmarks/probes/bandwidth_probes.py

Prints one JSON line and writes it to $OUT/probe-run35.json.
"""

import json
import os
import time

import jax

from lithos.bandwidth import measure_read_bandwidth, probe_array, reduction_layouts

PROBE_BYTES = 4 << 30


def host_timed(nbytes: int, repeats: int = 10) -> float:
    """The probe as lithos/bench.py had it before run 35: the best of single dispatches, host-timed."""
    x = probe_array(nbytes)
    best = float("inf")
    for reduction in reduction_layouts():
        run = jax.jit(reduction)
        run(x).block_until_ready()
        for _ in range(repeats):
            start = time.perf_counter()
            run(x).block_until_ready()
            best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def torch_event_timed(nbytes: int, loops: int = 20) -> float:
    import torch

    x = torch.ones((nbytes // 4,), dtype=torch.float32, device="cuda")
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(loops):
        x.sum()
    end.record()
    torch.cuda.synchronize()
    return x.numel() * 4 * loops / (start.elapsed_time(end) / 1e3)


def main() -> None:
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    start = time.perf_counter()
    result["device_timed_TBps"] = [measure_read_bandwidth(PROBE_BYTES) / 1e12 for _ in range(4)]
    result["device_timed_seconds_each"] = (time.perf_counter() - start) / 4
    result["host_timed_TBps"] = [host_timed(PROBE_BYTES) / 1e12 for _ in range(3)]
    try:
        result["torch_sum_event_timed_TBps"] = torch_event_timed(PROBE_BYTES) / 1e12
    except Exception as err:  # torch without CUDA: the other two probes still stand
        result["torch_error"] = repr(err)
    print(json.dumps(result))
    with open(os.path.join(os.environ.get("OUT", "."), "probe-run35.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
