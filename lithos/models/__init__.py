"""Model families. Each is a module with `Config`, `config_from_hf`, `config_from_gguf`,
`param_shapes`, `init_params` and `forward`; this table finds the module for a checkpoint."""

from __future__ import annotations

from types import ModuleType

from lithos.errors import UnsupportedModelError
from lithos.kv_cache import KVCache, init_cache
from lithos.models import gpt_oss, llama, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    arch: family for family in (llama, gpt_oss, qwen3_moe) for arch in family.ARCHITECTURES
}
GGUF_FAMILIES: dict[str, ModuleType] = {
    arch: family for family in (llama, gpt_oss, qwen3_moe) for arch in family.GGUF_ARCHITECTURES
}


def family_for_architecture(arch: str) -> ModuleType:
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[arch]


def family_for_gguf(gguf_arch: str, tensor_names: set[str] = frozenset()) -> ModuleType:
    """The family of a GGUF's `general.architecture`; a `llama` file whose layers hold experts is Mixtral's."""
    if gguf_arch in qwen3_moe.MIXTRAL_GGUF_ARCHITECTURES and "blk.0.ffn_gate_inp.weight" in tensor_names:
        return qwen3_moe
    if gguf_arch not in GGUF_FAMILIES:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(sorted(GGUF_FAMILIES))}"
        )
    return GGUF_FAMILIES[gguf_arch]


def family_of(cfg) -> ModuleType:
    return family_for_architecture(cfg.architecture)


def params_for_kernels(params, cfg, kernels: str):
    """`params` laid out as the kernel path `kernels` is set to read them (the family's `params_for_kernels`; the
    same params where a family has none): the same values."""
    prepare = getattr(family_of(cfg), "params_for_kernels", None)
    return params if prepare is None else prepare(params, cfg, kernels)


def init_model_cache(cfg, batch: int, max_len: int, dtype, step_tokens: int = 1) -> KVCache:
    """An empty KV cache for `cfg`'s model and sequences of up to `max_len` positions: a ring when its family
    says every layer is windowed (`cache_window`), made for forwards of up to `step_tokens` new tokens
    (k + 1 to verify k drafts; lithos.kv_cache)."""
    window = family_of(cfg).cache_window(cfg)
    dims = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return init_cache(*dims, dtype, window=window, step_tokens=step_tokens)
