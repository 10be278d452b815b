"""The per-device side of a tensor-parallel decode step: what each device does with its partial
results when the fused kernels run on its own shard inside `jax.shard_map`
(`lithos.placement.Placement.shard_step` builds the shard_map; `lithos.models.llama` calls these).

Each device holds its slice of the attention heads, of the FFN and (when it divides) of the
vocabulary, and the hidden state replicated. Per layer, the O projection and the down projection
each leave every device with a partial sum `[tokens, hidden]` over its heads / FFN rows; the sum is
the layer's update of the residual stream. Two schedules for that reduction:

plain       `psum`: one all-reduce of `[tokens, hidden]` after the projection, then the residual add.

overlapped  a collective matmul. The projection's output rows are cut into `tp` chunks, computed
            one after another; after each chunk the running partial sum of the chunk is passed to
            the next device of a ring (`ppermute`), which adds its own partial of the same chunk,
            while every device already computes its next chunk. After tp - 1 hops each device holds
            one chunk fully reduced (a reduce-scatter), adds its slice of the residual, and one
            all-gather rebuilds the hidden state. Chunk c of a weight stacked `[layers, hidden, k]`
            is entry `layer * tp + c` of the same buffer viewed as `[layers * tp, hidden / tp, k]`,
            a reshape that copies nothing, so the kernel reads only that chunk's rows.

Only the reduce-scatter half overlaps: the next op (RMSNorm, then the next matvec) needs the whole
reduced vector, and cutting the next matvec by its input columns would need a weight layout the
kernels do not read. At batch 1 the messages are small (a bf16 hidden vector: 8 KB for the
Llama-3.1-8B shape, 4 KB per chunk at tp=2), so each collective costs its latency, not its
bandwidth: the overlapped schedule trades one all-reduce for tp - 1 hidden permutes plus one
all-gather and tp - 1 extra kernel launches. It wins where an all-reduce costs more than an
all-gather plus a launch (several tokens per step, more devices, a slow all-reduce), which only a
machine with several GPUs can tell: see `lithos bench --tp 2 --tp-overlap`.

Embedding lookup and LM head over a vocabulary split: a device holds rows
`[rank * V/tp, (rank + 1) * V/tp)` of the table; the looked-up row is summed over devices (zero on
all but its owner), and the greedy token is the best of each device's best (`argmax_across_shards`),
so only `[tokens, tp]` pairs cross devices, never the logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

TP = "tp"  # the mesh axis the model is split over


def argmax_across_shards(best: jax.Array, token: jax.Array, axis: str = TP) -> jax.Array:
    """Inside a per-shard function over a vocab-split LM head: the greedy token from each shard's
    best logit `best` `[...]` and its global id `token` `[...]` (int32). Gathers the tp pairs
    (two all-gathers of `[..., tp]`, not the logits) and keeps the highest logit, the lowest id on
    a tie, as `jnp.argmax` over the whole vocabulary does."""
    bests = jax.lax.all_gather(best, axis, axis=-1, tiled=False)
    tokens = jax.lax.all_gather(token, axis, axis=-1, tiled=False)
    top = jnp.max(bests, axis=-1, keepdims=True)
    return jnp.min(jnp.where(bests == top, tokens, jnp.iinfo(tokens.dtype).max), axis=-1)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One device's view of a tensor-parallel step: the mesh axis, its size, whether the
    vocabulary is split, and which reduction schedule the projections use. Methods are called
    inside `jax.shard_map` over `axis` and see local shapes."""

    axis: str
    tp: int
    vocab_split: bool
    overlap: bool = False

    def embed_rows(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """Rows of the embedding `table` (this device's `[V/tp, hidden]`, or all of it) for global
        `tokens` `[tokens]`: `[tokens, hidden]`, the same on every device."""
        if not self.vocab_split:
            return table[tokens]
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(self.axis) * rows
        mine = (local >= 0) & (local < rows)
        found = jnp.where(mine[:, None], table[jnp.clip(local, 0, rows - 1)], jnp.zeros((), table.dtype))
        return jax.lax.psum(found, self.axis)  # one device contributes each row: the sum is exact

    def project_residual(self, x: jax.Array, w: jax.Array, layer: jax.Array, residual: jax.Array) -> jax.Array:
        """`residual + sum over devices of x @ w[layer].T`: x `[tokens, k]` (this device's heads or FFN
        slice), w `[layers, hidden, k]` (its columns of wo or w_down), residual `[tokens, hidden]`
        replicated. Returns the new hidden state `[tokens, hidden]`, replicated."""
        from lithos.custom_calls import matvec

        if self.overlap and self.tp > 1:
            return self._ring_project_residual(x, w, layer, residual)
        return residual + jax.lax.psum(matvec(x, w, layer=layer), self.axis)

    def _ring_project_residual(self, x, w, layer, residual):
        """The overlapped schedule (module docstring): tp chunk matvecs, tp - 1 ring hops, one all-gather."""
        from lithos.custom_calls import matvec

        layers, hidden, k = w.shape
        size = hidden // self.tp
        chunks = w.reshape(layers * self.tp, size, k)
        rank = jax.lax.axis_index(self.axis)
        next_device = [(i, (i + 1) % self.tp) for i in range(self.tp)]
        partial = None
        for step in range(self.tp):
            # The chunk this device adds to at `step` reaches its owner after the remaining hops:
            # at the last step every device works on its own chunk.
            chunk = (rank - step - 1) % self.tp
            mine = matvec(x, chunks, layer=layer * self.tp + chunk)  # independent of the hop in flight
            partial = mine if partial is None else partial + mine
            if step < self.tp - 1:
                partial = jax.lax.ppermute(partial, self.axis, next_device)
        own = jax.lax.dynamic_slice_in_dim(residual, rank * size, size, axis=1)
        return jax.lax.all_gather(own + partial, self.axis, axis=1, tiled=True)

    def head_tokens(self, h: jax.Array, head: jax.Array, norm_weight: jax.Array, eps: float) -> jax.Array:
        """Greedy tokens `[tokens]` (int32, global ids, replicated) for h `[tokens, hidden]` through
        RMSNorm and this device's rows of the LM head `[V/tp, hidden]`."""
        from lithos.custom_calls import lm_head_argmax

        if not self.vocab_split:
            return lm_head_argmax(h, head, norm_weight=norm_weight, eps=eps)
        # The kernel's own logits give its winner's logit exactly, so devices compare like with like.
        ids, logits = lm_head_argmax(h, head, norm_weight=norm_weight, eps=eps, with_logits=True)
        best = jnp.take_along_axis(logits, ids[:, None], axis=1)[:, 0]
        offset = jax.lax.axis_index(self.axis) * head.shape[0]
        return argmax_across_shards(best, ids + offset.astype(ids.dtype), self.axis)

    def head_logits(self, h: jax.Array, head: jax.Array, norm_weight: jax.Array, eps: float) -> jax.Array:
        """This device's logits `[tokens, V/tp]` (float32; all of them when the vocabulary is replicated)."""
        from lithos.custom_calls import lm_head_argmax

        _, logits = lm_head_argmax(h, head, norm_weight=norm_weight, eps=eps, with_logits=True)
        return logits
