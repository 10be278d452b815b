"""Launch parameters of the fused kernels, read at trace time from the table `lithos tune` writes.

The table is one JSON file per device kind (`tuning/<device-slug>.json` beside this module, e.g.
`tuning/nvidia-h200.json`; `$LITHOS_TUNING_DIR` points elsewhere), keyed by problem:

    "matvec in=2048 out=2048 T=1": {"params": {"k_split": 8, "blocks_per_unit": 2}, "us": ..., ...}

A key names the kernel, its problem dimensions and the token-count bucket the kernel is compiled
for (1, 2, 4, 8, 16). Each parameter reaches the kernel as an int64 FFI attribute; 0, and every
problem the table does not hold, means the kernel's own heuristic (the 24-warps-per-SM split rule,
the one-wave grid, the attention split plan). `LITHOS_TUNING=off` ignores the table (to measure the
heuristics beside it).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from lithos.errors import LithosError

TABLE_DIR = Path(__file__).parent / "tuning"
TABLE_FORMAT = 1

_ROW_GROUP = ("k_split", "warps_per_block", "blocks_per_unit")
# Kernel -> the launch parameters its handler takes (FFI attribute names, see csrc/rowdot.h and
# csrc/attention.cu) and the problem dimensions that key its table entries, in key order.
LAUNCH_PARAMS: dict[str, tuple[str, ...]] = {
    "matvec": _ROW_GROUP,
    "gate_up_silu": _ROW_GROUP,
    "qkv_rope_append": _ROW_GROUP,
    "lm_head_argmax": _ROW_GROUP,
    "decode_attention": ("splits", "split_keys"),
}
PROBLEM_DIMS: dict[str, tuple[str, ...]] = {
    "matvec": ("in", "out"),
    "gate_up_silu": ("in", "out"),
    "qkv_rope_append": ("hidden", "heads", "kv_heads", "head_dim"),
    "lm_head_argmax": ("hidden", "vocab"),
    # cache = the KV cache length rounded up to a power of two: the split plan depends on it.
    "decode_attention": ("heads", "kv_heads", "head_dim", "cache"),
}
TOKEN_BUCKETS = (1, 2, 4, 8, 16)


def token_bucket(tokens: int) -> int:
    """The token count the kernels are instantiated for (csrc/ffi_util.h's with_token_bucket)."""
    for bucket in TOKEN_BUCKETS:
        if tokens <= bucket:
            return bucket
    raise LithosError(f"the fused kernels take 1..{TOKEN_BUCKETS[-1]} query positions, got {tokens}")


def length_bucket(length: int) -> int:
    """`length` rounded up to a power of two (at least 1)."""
    return 1 << max(int(length) - 1, 0).bit_length()


def problem_key(kernel: str, dims: Mapping[str, int], tokens: int) -> str:
    """The table key of one problem, e.g. "matvec in=2048 out=2048 T=1" (tokens are bucketed)."""
    if kernel not in PROBLEM_DIMS:
        raise LithosError(
            f"no launch parameters for kernel {kernel!r}; the tunable kernels are {', '.join(LAUNCH_PARAMS)}"
        )
    if set(dims) != set(PROBLEM_DIMS[kernel]):
        raise LithosError(f"{kernel}: a problem is keyed by {', '.join(PROBLEM_DIMS[kernel])}, got {', '.join(dims)}")
    shape = " ".join(f"{name}={int(dims[name])}" for name in PROBLEM_DIMS[kernel])
    return f"{kernel} {shape} T={token_bucket(tokens)}"


def device_slug(device_kind: str) -> str:
    """File-name form of a device kind: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"


@functools.cache
def current_device_kind() -> str:
    """The kind of the device jax runs on by default, e.g. "NVIDIA H200" (or "cpu")."""
    return jax.devices()[0].device_kind


def table_path(device_kind: str | None = None) -> Path:
    kind = device_kind or current_device_kind()
    return Path(os.environ.get("LITHOS_TUNING_DIR", TABLE_DIR)) / f"{device_slug(kind)}.json"


def check_params(kernel: str, params: Mapping[str, Any], where: str) -> dict[str, int]:
    """`params` as ints after checking the names and signs; `where` names their source in errors."""
    known = LAUNCH_PARAMS.get(kernel)
    if known is None:
        raise LithosError(
            f"{where}: no launch parameters for kernel {kernel!r}; the tunable kernels are {', '.join(LAUNCH_PARAMS)}"
        )
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise LithosError(
            f"{where}: {kernel} has no launch parameter {', '.join(unknown)}; it takes {', '.join(known)}"
        )
    checked = {}
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise LithosError(f"{where}: {kernel} {name} must be an integer >= 0 (0 = heuristic), got {value!r}")
        checked[name] = int(value)
    return checked


def read_table(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of the table at `path` ({} when there is no file), checked."""
    return dict(_read_table(Path(path), _mtime(path)))


def _mtime(path: Path) -> int | None:
    try:
        return Path(path).stat().st_mtime_ns
    except FileNotFoundError:
        return None


@functools.lru_cache(maxsize=16)
def _read_table(path: Path, mtime: int | None) -> dict[str, dict[str, Any]]:
    # Keyed by the modification time too: a table rewritten by `lithos tune` is read again.
    if mtime is None:
        return {}
    fix = f"re-run `lithos tune` or delete {path}"
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LithosError(f"the tuning table {path} is unreadable ({e}): {fix}") from e
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT or not isinstance(table.get("entries"), dict):
        raise LithosError(f"the tuning table {path} is not format {TABLE_FORMAT} ({{format, device, entries}}): {fix}")
    for key, entry in table["entries"].items():
        kernel = key.split(" ", 1)[0]
        if not isinstance(entry, dict) or not isinstance(entry.get("params"), dict):
            raise LithosError(f"the tuning table {path}: entry {key!r} has no params: {fix}")
        check_params(kernel, entry["params"], f"the tuning table {path}, entry {key!r}")
    return table["entries"]


def write_table(path: Path, device_kind: str, entries: Mapping[str, Mapping[str, Any]]) -> Path:
    """Merge `entries` into the table at `path` (new keys replace old ones), sorted by key."""
    path = Path(path)
    merged = read_table(path) | {key: dict(entry) for key, entry in entries.items()}
    for key, entry in merged.items():
        check_params(key.split(" ", 1)[0], entry["params"], f"tuning entry {key!r}")
    table = {"format": TABLE_FORMAT, "device": device_kind, "entries": dict(sorted(merged.items()))}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def tuning_enabled() -> bool:
    return os.environ.get("LITHOS_TUNING", "on").lower() not in ("0", "off", "false", "no")


def tuned_params(kernel: str, dims: Mapping[str, int], tokens: int, device_kind: str | None = None) -> dict[str, int]:
    """The table's parameters for this problem on this device, {} where it has none."""
    if not tuning_enabled():
        return {}
    entry = read_table(table_path(device_kind)).get(problem_key(kernel, dims, tokens))
    return dict(entry["params"]) if entry else {}


def launch_attributes(
    kernel: str, dims: Mapping[str, int], tokens: int, launch: Mapping[str, int] | None = None
) -> dict[str, np.int64]:
    """FFI attributes for one call: `launch` when given (explicit, e.g. a trial of `lithos tune`), else
    the table's entry for this device and problem; every parameter not set is 0 (the heuristic)."""
    if launch is None:
        params = tuned_params(kernel, dims, tokens)
    else:
        params = check_params(kernel, launch, f"{kernel}(launch=...)")
    return {name: np.int64(params.get(name, 0)) for name in LAUNCH_PARAMS[kernel]}
