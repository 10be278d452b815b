"""lithos's own checkpoint format: converted parameters saved with orbax, beside the config and
what the tokenizer needs, so the second load of a model skips parsing and dequantising.

Layout of a converted directory:
    lithos.json        {"format": 1, "config": {...}, "dtype": "bfloat16", "source": "...",
                        "formats": {"layers.wq": "q4_1", ...},   (packed parameters only; may be absent)
                        "rounding": "..."}   (what the conversion rounded and how not to; may be absent)
    tokenizer/         tokenizer.json etc. (HF sources) or gguf_tokenizer.json (GGUF sources)
    params/            orbax checkpoint of {"embed": ..., "layers": {"wq": ...}, ...}; a packed
                       parameter is a group of its planes, {"layers": {"wq": {"data", "scales", "mins"}}}
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from lithos.errors import CheckpointError
from lithos.quant import QuantizedArray, from_planes, get_format

FORMAT_VERSION = 1
MARKER = "lithos.json"


def is_converted(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat |= _flatten(v, f"{prefix}{k}.")
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def config_to_json(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_json(d: dict[str, Any]):
    from lithos.models import family_for_architecture

    family = family_for_architecture(d["architecture"])
    fields = dict(d)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = family.RopeScaling(**fields["rope_scaling"])
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids") or ())
    return family.Config(**fields)


def save(
    path: Path,
    cfg,
    flat_params: dict[str, jax.Array],
    dtype: str,
    source: str,
    tokenizer_files,
    rounding: str | None = None,
) -> None:
    """Write a converted checkpoint. `tokenizer_files` is a callable that fills a directory; `rounding`
    is the warning the conversion gave about values it rounded, repeated whenever the copy is loaded."""
    import orbax.checkpoint as ocp

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer_files(tmp / "tokenizer")
    checkpointer = ocp.StandardCheckpointer()
    formats = {n: w.format.name for n, w in flat_params.items() if isinstance(w, QuantizedArray)}
    planes = {n: w.planes() if isinstance(w, QuantizedArray) else w for n, w in flat_params.items()}
    checkpointer.save((tmp / "params").absolute(), _nest(planes))
    checkpointer.wait_until_finished()
    meta = {"format": FORMAT_VERSION, "config": config_to_json(cfg), "dtype": dtype, "source": source}
    if formats:
        meta["formats"] = formats
    if rounding:
        meta["rounding"] = rounding
    (tmp / MARKER).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # the marker appears only once everything is written


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / MARKER} is unreadable ({e}): convert the model again") from e
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was converted by another lithos version (format {meta.get('format')}); convert it again"
        )
    return meta


def restore(
    path: Path, shapes: dict[str, tuple[int, ...]], dtype, sharding=None, formats: dict[str, str] | None = None
) -> dict[str, jax.Array]:
    """Restore flat params of the given (logical) shapes straight onto the device (or `sharding`);
    names in `formats` are packed in that format and come back as QuantizedArray standing for `dtype`."""
    import orbax.checkpoint as ocp

    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    formats = formats or {}

    def abstract(name: str, shape: tuple[int, ...]):
        if name not in formats:
            return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)
        planes = get_format(formats[name]).plane_shapes(shape)
        return {p: jax.ShapeDtypeStruct(s, d, sharding=sharding) for p, (s, d) in planes.items()}

    target = _nest({n: abstract(n, s) for n, s in shapes.items()})
    try:
        tree = ocp.StandardCheckpointer().restore((path / "params").absolute(), target)
    except Exception as e:  # orbax wraps tensorstore errors in many types
        raise CheckpointError(f"{path}/params cannot be restored ({type(e).__name__}: {e}); convert again") from e
    flat = _flatten(tree)
    for name, fmt in formats.items():  # _flatten split each packed parameter into its planes
        planes = {p: flat.pop(f"{name}.{p}") for p in get_format(fmt).plane_shapes(shapes[name])}
        flat[name] = from_planes(fmt, planes, dtype)
    return flat
