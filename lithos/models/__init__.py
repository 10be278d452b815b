"""Model families. Each is a module with `Config`, `config_from_hf`, `config_from_gguf`,
`param_shapes`, `init_params` and `forward`; this table finds the module for a checkpoint."""

from __future__ import annotations

from types import ModuleType

from lithos.errors import UnsupportedModelError
from lithos.models import gpt_oss, llama, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    arch: family for family in (llama, gpt_oss, qwen3_moe) for arch in family.ARCHITECTURES
}
GGUF_FAMILIES: dict[str, ModuleType] = {arch: llama for arch in llama.GGUF_ARCHITECTURES}


def family_for_architecture(arch: str) -> ModuleType:
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[arch]


def family_for_gguf(gguf_arch: str) -> ModuleType:
    if gguf_arch not in GGUF_FAMILIES:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(sorted(GGUF_FAMILIES))}"
        )
    return GGUF_FAMILIES[gguf_arch]


def family_of(cfg) -> ModuleType:
    return family_for_architecture(cfg.architecture)
