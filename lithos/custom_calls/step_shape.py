"""The dimensions of a Llama-family decode step that the kernels see: what the tuner, the microbench
and the megakernel's scheduler size their work by."""

from __future__ import annotations

import dataclasses

from lithos.errors import LithosError


@dataclasses.dataclass(frozen=True)
class StepShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def q_size(self) -> int:
        """Length of the query (and attention output) row: heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @classmethod
    def from_config(cls, cfg, tool: str = "lithos") -> StepShape:
        """The shape of a model config; `tool` names what needs it in the error for a model without dense
        Llama-family decoder layers."""
        needed = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
        # Mixture-of-experts configs have the same fields, but their intermediate_size is one expert's.
        if not all(hasattr(cfg, name) for name in needed) or getattr(cfg, "num_experts", 0):
            raise LithosError(
                f"{tool} times the dense Llama-family kernels; {getattr(cfg, 'architecture', cfg)} has no "
                "dense decoder layers of that form"
            )
        return cls(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
        )

    @classmethod
    def named(cls, name: str, tool: str = "lithos") -> StepShape:
        """The shape of a model in configs/models (`llama-3.2-1b`, ...)."""
        from lithos import bench  # the configs directory's reader; bench imports the kernels

        return cls.from_config(bench.model_shape(name), tool)
