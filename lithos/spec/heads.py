"""Trained draft heads: EAGLE-3 style and MTP, read from a documented checkpoint layout.

Both are one decoder layer that reads the target's hidden states and predicts the token after
next. An entry at position `j` consumes the pair (hidden feature at `j`, embedding of the token at
`j + 1`) and predicts the token at `j + 2`. The first draft of a round uses the target's own
features; each later draft feeds back the head's output hidden state (chain drafting). The head
keeps its own one-layer KV cache, whose entries below the round's first position always come from
the target's features (see `HeadDrafter`).

- **eagle3** (Li et al., EAGLE-3): features are the residual streams entering three target layers
  (default 2, L/2 and L-3), concatenated `[B, T, 3d]` and fused by `fc` to `d`. The layer's
  attention input is `[input_layernorm(embedding), hidden_norm(fused)]` `[.., 2d]`, its residual is
  the fused hidden state; then the usual MLP; `norm` and a `lm_head` over a reduced draft
  vocabulary whose ids map back to the target's by `d2t` (target id = draft id + d2t[draft id]).
- **mtp** (DeepSeek-V3 multi-token prediction, one module): the feature is the target's last layer
  output before its final norm; `eh_proj` projects `[enorm(embedding), hnorm(hidden)]` `[.., 2d]`
  to `d`, then a standard pre-norm decoder layer; `norm` and the target's LM head (or its own).

Checkpoint layout: a directory with `config.json` and `model.safetensors` (or `pytorch_model.bin`,
read with torch when installed). The tensor names are those of EAGLE-3's published checkpoints, so
one of those loads as it ships; a leading `model.` is ignored. See lithos/spec/README.md.

config.json keys:
    "lithos_draft_head": "eagle3" | "mtp"   (or "architectures": ["LlamaForCausalLMEagle3"])
    "hidden_size" (must equal the target's), "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim" (default hidden/heads), "rms_norm_eps",
    "rope_theta", "rope_scaling" (default: the target's), "vocab_size" (the target's),
    "draft_vocab_size" (default vocab_size), "feature_layers" (optional; see above)

Tensors (`D_in` = 2d for eagle3, d for mtp; `Vd` = draft_vocab_size):
    midlayer.self_attn.q_proj.weight   [heads*head_dim, D_in]
    midlayer.self_attn.k_proj.weight   [kv_heads*head_dim, D_in]
    midlayer.self_attn.v_proj.weight   [kv_heads*head_dim, D_in]
    midlayer.self_attn.o_proj.weight   [d, heads*head_dim]
    midlayer.input_layernorm.weight    [d]   eagle3: norm of the token embedding; mtp: attention pre-norm
    midlayer.post_attention_layernorm.weight [d]
    midlayer.mlp.gate_proj.weight      [ffn, d]
    midlayer.mlp.up_proj.weight        [ffn, d]
    midlayer.mlp.down_proj.weight      [d, ffn]
    norm.weight                        [d]   the final norm before the LM head
    lm_head.weight                     [Vd, d]  (eagle3: required; mtp: optional, default the target's)
    embed_tokens.weight                [vocab, d]  optional, default the target's embedding
    eagle3 only: fc.weight [d, 3d]; midlayer.hidden_norm.weight [d]; d2t [Vd] int (if Vd < vocab)
    mtp only:    enorm.weight [d]; hnorm.weight [d]; eh_proj.weight [d, 2d]
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lithos.errors import CheckpointError, LithosError
from lithos.kv_cache import KVCache, append, init_cache
from lithos.models import llama
from lithos.sampling import SamplingParams
from lithos.spec.drafter import DraftContext, PromptContext, Proposal, Verified, autoregress
from lithos.spec.target import check_llama_family

HEAD_KINDS = ("eagle3", "mtp")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """A draft head's static description."""

    kind: str  # "eagle3" or "mtp"
    layer: llama.Config  # the head's decoder layer: heads, head_dim, ffn, rope, eps (num_layers 1)
    feature_layers: tuple[int, ...]  # target residual streams read (see lithos.spec.target)
    vocab_size: int  # the target's
    draft_vocab_size: int

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def attn_in(self) -> int:
        """Width of the attention input: eagle3 attends over [embedding; hidden]."""
        return 2 * self.hidden_size if self.kind == "eagle3" else self.hidden_size

    def describe(self) -> str:
        return (
            f"{self.kind} head: features {list(self.feature_layers)}, draft vocab {self.draft_vocab_size}, "
            f"{self.layer.num_heads}/{self.layer.num_kv_heads} heads, ffn {self.layer.intermediate_size}"
        )


@struct.dataclass
class HeadParams:
    """A draft head's weights; matrices `[out, in]` as in the checkpoint."""

    wq: jax.Array  # [heads*head_dim, attn_in]
    wk: jax.Array  # [kv_heads*head_dim, attn_in]
    wv: jax.Array  # [kv_heads*head_dim, attn_in]
    wo: jax.Array  # [d, heads*head_dim]
    mlp_norm: jax.Array  # [d]
    w_gate: jax.Array  # [ffn, d]
    w_up: jax.Array  # [ffn, d]
    w_down: jax.Array  # [d, ffn]
    emb_norm: jax.Array  # [d]: eagle3 input_layernorm, mtp enorm
    hidden_norm: jax.Array  # [d]: eagle3 hidden_norm, mtp hnorm
    norm: jax.Array  # [d]
    attn_norm: jax.Array | None = None  # [d] mtp only: the layer's pre-attention norm
    fc: jax.Array | None = None  # [d, n_features*d] eagle3 only
    eh_proj: jax.Array | None = None  # [d, 2d] mtp only
    lm_head: jax.Array | None = None  # [draft_vocab, d]; None: the target's LM head
    draft_to_target: jax.Array | None = None  # [draft_vocab] i32 target ids; None: identity
    embed: jax.Array | None = None  # [vocab, d]; None: the target's embedding


# Checkpoint tensor name -> HeadParams field.
_COMMON_NAMES = {
    "midlayer.self_attn.q_proj.weight": "wq",
    "midlayer.self_attn.k_proj.weight": "wk",
    "midlayer.self_attn.v_proj.weight": "wv",
    "midlayer.self_attn.o_proj.weight": "wo",
    "midlayer.post_attention_layernorm.weight": "mlp_norm",
    "midlayer.mlp.gate_proj.weight": "w_gate",
    "midlayer.mlp.up_proj.weight": "w_up",
    "midlayer.mlp.down_proj.weight": "w_down",
    "norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "embed_tokens.weight": "embed",
}
TENSOR_NAMES = {
    "eagle3": {
        **_COMMON_NAMES,
        "midlayer.input_layernorm.weight": "emb_norm",
        "midlayer.hidden_norm.weight": "hidden_norm",
        "fc.weight": "fc",
    },
    "mtp": {
        **_COMMON_NAMES,
        "midlayer.input_layernorm.weight": "attn_norm",
        "enorm.weight": "emb_norm",
        "hnorm.weight": "hidden_norm",
        "eh_proj.weight": "eh_proj",
    },
}
OPTIONAL_FIELDS = {"lm_head", "embed", "draft_to_target"}


def default_feature_layers(kind: str, num_layers: int) -> tuple[int, ...]:
    """EAGLE-3: low, middle and high layers (2, L/2, L-3); MTP: the last layer's output."""
    if kind == "eagle3":
        return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))
    return (num_layers,)


def param_shapes(head: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HeadParams field the head uses (optional ones included)."""
    lc, d = head.layer, head.hidden_size
    shapes = {
        "wq": (lc.q_size, head.attn_in),
        "wk": (lc.kv_size, head.attn_in),
        "wv": (lc.kv_size, head.attn_in),
        "wo": (d, lc.q_size),
        "mlp_norm": (d,),
        "w_gate": (lc.intermediate_size, d),
        "w_up": (lc.intermediate_size, d),
        "w_down": (d, lc.intermediate_size),
        "emb_norm": (d,),
        "hidden_norm": (d,),
        "norm": (d,),
        "lm_head": (head.draft_vocab_size, d),
        "embed": (head.vocab_size, d),
        "draft_to_target": (head.draft_vocab_size,),
    }
    if head.kind == "eagle3":
        shapes["fc"] = (d, len(head.feature_layers) * d)
    else:
        shapes["attn_norm"] = (d,)
        shapes["eh_proj"] = (d, 2 * d)
    return shapes


def head_config(
    kind: str,
    target_cfg: llama.Config,
    feature_layers: tuple[int, ...] | None = None,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
) -> HeadConfig:
    """A head shaped for `target_cfg`: its attention and MLP like one target layer unless told."""
    if kind not in HEAD_KINDS:
        raise LithosError(f"draft head kind {kind!r} is not known; choose one of {', '.join(HEAD_KINDS)}")
    check_llama_family(target_cfg, "a draft head")
    layer = dataclasses.replace(
        target_cfg,
        num_layers=1,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding_window=None,
    )
    features = tuple(feature_layers) if feature_layers else default_feature_layers(kind, target_cfg.num_layers)
    if any(not 0 <= f <= target_cfg.num_layers for f in features):
        raise LithosError(f"feature layers {list(features)} must lie in 0..{target_cfg.num_layers}")
    if kind == "mtp" and len(features) != 1:
        raise LithosError(f"an MTP head reads one feature layer, got {list(features)}")
    return HeadConfig(kind, layer, features, target_cfg.vocab_size, draft_vocab_size or target_cfg.vocab_size)


def init_head(head: HeadConfig, seed: int = 0, dtype=jnp.float32) -> HeadParams:
    """Random head weights (for tests and benchmarks), drawn with numpy so that they cost no
    compilation. With a reduced draft vocabulary, `d2t` picks `draft_vocab_size` random target ids."""
    rng = np.random.default_rng(seed)
    skip = {"embed", "draft_to_target"} | ({"lm_head"} if head.kind == "mtp" else set())
    fields: dict[str, Any] = {}
    for name, shape in sorted(param_shapes(head).items()):
        if name in skip:
            continue
        if name.endswith("norm"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        fields[name] = jnp.asarray(value.astype(np.float32), dtype)
    if head.draft_vocab_size != head.vocab_size:
        ids = np.sort(rng.permutation(head.vocab_size)[: head.draft_vocab_size])
        fields["draft_to_target"] = jnp.asarray(ids, jnp.int32)
    return HeadParams(**fields)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def fuse(head: HeadConfig, params: HeadParams, features: jax.Array) -> jax.Array:
    """Target features `[..., n*d]` -> the head's hidden input `[..., d]` (eagle3: fc; mtp: as is)."""
    return llama.linear(features, params.fc) if head.kind == "eagle3" else features


def head_step(
    head: HeadConfig,
    params: HeadParams,
    target_params: llama.Params,
    hidden: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One pass of the head over pairs (hidden `[B, T, d]` at `positions` `[B, T]`, next `tokens` `[B, T]`).

    Returns the head's output hidden states `[B, T, d]` (fed back for the next draft), logits over
    the target's vocabulary `[B, T, vocab]` f32 (-inf outside a reduced draft vocabulary), and its
    one-layer cache `[1, B, kv_heads, max_len, head_dim]` with these positions stored.
    """
    lc = head.layer
    eps = lc.rms_norm_eps
    embed = target_params.embed if params.embed is None else params.embed
    emb = embed[tokens].astype(hidden.dtype)
    pair = jnp.concatenate(
        [llama.rms_norm(emb, params.emb_norm, eps), llama.rms_norm(hidden, params.hidden_norm, eps)], axis=-1
    )
    if head.kind == "eagle3":
        residual, x = hidden, pair
    else:
        residual = llama.linear(pair, params.eh_proj)
        x = llama.rms_norm(residual, params.attn_norm, eps)

    batch, length = tokens.shape
    inv_freq = llama.rope_inv_freq(lc)
    q = llama.linear(x, params.wq).reshape(batch, length, lc.num_heads, lc.head_dim)
    k = llama.linear(x, params.wk).reshape(batch, length, lc.num_kv_heads, lc.head_dim)
    v = llama.linear(x, params.wv).reshape(batch, length, lc.num_kv_heads, lc.head_dim)
    q = llama.apply_rope(q, positions, inv_freq)
    k = llama.apply_rope(k, positions, inv_freq)
    attn = llama.attention(q, k, v, cache.k[0], cache.v[0], positions, lc)
    h = residual + llama.linear(attn, params.wo)
    x = llama.rms_norm(h, params.mlp_norm, eps)
    h = h + llama.linear(jax.nn.silu(llama.linear(x, params.w_gate)) * llama.linear(x, params.w_up), params.w_down)
    cache = append(cache, positions, k[None], v[None])

    final = llama.rms_norm(h, params.norm, eps)
    if params.lm_head is not None:
        logits = jnp.einsum("...d,vd->...v", final, params.lm_head, preferred_element_type=jnp.float32)
    else:
        logits = llama.lm_logits(target_params, final)
    if params.draft_to_target is not None:
        full = jnp.full((*logits.shape[:-1], head.vocab_size), -jnp.inf, jnp.float32)
        logits = full.at[..., params.draft_to_target].set(logits)
    return h, logits, cache


# --------------------------------------------------------------------------------------------
# Drafter
# --------------------------------------------------------------------------------------------


@struct.dataclass
class HeadState:
    """The head's per-request state."""

    cache: KVCache  # [1, B, kv_heads, max_len, head_dim]; right below `pending_start`
    pending: jax.Array  # [B, k+1, n*d]: target features at positions pending_start + i
    pending_start: jax.Array  # [B] i32


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
    """Chain drafting with a trained head (`draft_params` are its HeadParams).

    Each round's first head pass covers the pairs from the previous round's first position up to
    the newest token, with the features the target computed while verifying them; so the head's
    cache below the new round is always built from the target's features, never from its own
    guesses. Pairs past the newest token in that pass, and the entries of the later chained drafts,
    sit at positions the next round rewrites first.
    """

    head: HeadConfig
    name: ClassVar[str] = "head"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def init(self, draft_params: HeadParams, target_params: Any, prompt: PromptContext) -> HeadState:
        lc = self.head.layer
        batch = prompt.history.shape[0]
        dtype = draft_params.wq.dtype
        cache = init_cache(1, batch, lc.num_kv_heads, prompt.max_len, lc.head_dim, dtype)
        features = prompt.features.astype(dtype)
        following = prompt.history[:, 1 : prompt.bucket + 1]  # the token after each prompt position
        positions = jnp.broadcast_to(jnp.arange(prompt.bucket, dtype=jnp.int32), following.shape)
        hidden = fuse(self.head, draft_params, features)
        _, _, cache = head_step(self.head, draft_params, target_params, hidden, following, positions, cache)
        last = jnp.take_along_axis(features, (prompt.lengths - 1)[:, None, None], axis=1)  # [B, 1, F]
        pending = jnp.zeros((batch, prompt.draft_tokens + 1, features.shape[-1]), dtype).at[:, :1].set(last)
        return HeadState(cache=cache, pending=pending, pending_start=(prompt.lengths - 1).astype(jnp.int32))

    def propose(
        self,
        draft_params: HeadParams,
        draft_state: HeadState,
        ctx: DraftContext,
        k: int,
        key: jax.Array,
        sampling: SamplingParams,
        greedy: bool,
    ) -> Proposal:
        head, tparams = self.head, ctx.target_params
        width = draft_state.pending.shape[1]
        positions = draft_state.pending_start[:, None] + jnp.arange(width)[None, :]
        following = jnp.take_along_axis(ctx.history, jnp.minimum(positions + 1, ctx.history.shape[1] - 1), axis=1)
        hidden = fuse(head, draft_params, draft_state.pending)
        h, logits, cache = head_step(head, draft_params, tparams, hidden, following, positions, draft_state.cache)
        newest_pair = (ctx.position - 1 - draft_state.pending_start)[:, None]  # the pair that ends at the newest token
        h = jnp.take_along_axis(h, newest_pair[..., None], axis=1)[:, 0]
        first = jnp.take_along_axis(logits, newest_pair[..., None], axis=1)[:, 0]

        def step(carry, token, i):
            cache, hidden = carry
            h, logits, cache = head_step(
                head, draft_params, tparams, hidden[:, None], token[:, None], (ctx.position + i - 1)[:, None], cache
            )
            return (cache, h[:, 0]), logits[:, 0]

        tokens, probs, (cache, _) = autoregress(step, (cache, h), first, k, key, sampling, greedy)
        return Proposal(
            tokens=tokens, probs=probs, draft_state=draft_state.replace(cache=cache), target_cache=ctx.target_cache
        )

    def update(self, draft_params: HeadParams, draft_state: HeadState, verified: Verified) -> HeadState:
        active = verified.active
        return draft_state.replace(
            pending=jnp.where(
                active[:, None, None], verified.features.astype(draft_state.pending.dtype), draft_state.pending
            ),
            pending_start=jnp.where(active, verified.round_start, draft_state.pending_start),
        )

    def describe(self) -> str:
        return self.head.describe()


# --------------------------------------------------------------------------------------------
# Checkpoint layout
# --------------------------------------------------------------------------------------------


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    st = path / "model.safetensors"
    if st.is_file():
        from safetensors.numpy import load_file

        try:
            tensors = load_file(st)
        except Exception as e:  # safetensors raises its own types for corrupt files
            raise CheckpointError(f"{st} could not be read ({e}): re-export the head") from e
    elif (path / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError as e:
            raise CheckpointError(
                f"{path} holds pytorch_model.bin, which needs torch to read: install torch, or convert it "
                "to model.safetensors"
            ) from e
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}
    else:
        raise CheckpointError(f"{path} has neither model.safetensors nor pytorch_model.bin: not a draft head")
    return {name.removeprefix("model."): t for name, t in tensors.items()}


def _kind_of(cfg: dict[str, Any], path: Path) -> str:
    kind = cfg.get("lithos_draft_head")
    if kind is None and any(a in EAGLE3_ARCHITECTURES for a in cfg.get("architectures") or ()):
        kind = "eagle3"
    if kind not in HEAD_KINDS:
        raise CheckpointError(
            f'{path / "config.json"} does not say which draft head it is: set "lithos_draft_head" to one of '
            f"{', '.join(HEAD_KINDS)}"
        )
    return kind


def load_head(path: str | Path, target_cfg: llama.Config, dtype=jnp.float32) -> tuple[HeadConfig, HeadParams]:
    """Read a draft head for `target_cfg` from `path` (layout in this module's docstring)."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: a draft head is a directory with config.json and weights")
    cfg = json.loads((path / "config.json").read_text())
    kind = _kind_of(cfg, path)
    if int(cfg.get("hidden_size", -1)) != target_cfg.hidden_size:
        raise CheckpointError(
            f"{path}: the head's hidden_size {cfg.get('hidden_size')} differs from the target's "
            f"{target_cfg.hidden_size}: it was trained for another model"
        )
    if int(cfg.get("vocab_size", target_cfg.vocab_size)) != target_cfg.vocab_size:
        raise CheckpointError(
            f"{path}: the head's vocab_size {cfg['vocab_size']} differs from the target's {target_cfg.vocab_size}"
        )
    head = head_config(
        kind,
        target_cfg,
        feature_layers=cfg.get("feature_layers"),
        draft_vocab_size=cfg.get("draft_vocab_size"),
        intermediate_size=cfg.get("intermediate_size"),
    )
    layer_overrides = {}
    for key, field in (("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads")):
        if key in cfg:
            layer_overrides[field] = int(cfg[key])
    if "head_dim" in cfg or "num_attention_heads" in cfg:
        heads = layer_overrides.get("num_heads", target_cfg.num_heads)
        layer_overrides["head_dim"] = int(cfg.get("head_dim") or target_cfg.hidden_size // heads)
    if "rms_norm_eps" in cfg:
        layer_overrides["rms_norm_eps"] = float(cfg["rms_norm_eps"])
    if "rope_theta" in cfg or "rope_scaling" in cfg or "rope_parameters" in cfg:
        theta, scaling = llama._rope_scaling_from_hf(cfg)
        layer_overrides |= {"rope_theta": theta, "rope_scaling": scaling}
    head = dataclasses.replace(head, layer=dataclasses.replace(head.layer, **layer_overrides))

    tensors = _read_tensors(path)
    names = TENSOR_NAMES[kind]
    shapes = param_shapes(head)
    fields: dict[str, Any] = {}
    for name, field in names.items():
        if name not in tensors:
            if field in OPTIONAL_FIELDS and not (field == "lm_head" and kind == "eagle3"):
                continue
            raise CheckpointError(f"{path} lacks tensor {name!r}, which a {kind} head needs")
        array = tensors[name]
        if tuple(array.shape) != shapes[field]:
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(array.shape)} but config.json implies {shapes[field]}"
            )
        fields[field] = jnp.asarray(array.astype(np.float32), dtype)
    if head.draft_vocab_size != head.vocab_size:
        if "d2t" not in tensors:
            raise CheckpointError(f"{path}: draft_vocab_size < vocab_size needs the d2t table (draft id -> offset)")
        offsets = np.asarray(tensors["d2t"]).astype(np.int64)
        if offsets.shape != (head.draft_vocab_size,):
            raise CheckpointError(f"{path}: d2t has shape {offsets.shape}, expected ({head.draft_vocab_size},)")
        ids = np.arange(head.draft_vocab_size) + offsets
        if ids.min() < 0 or ids.max() >= head.vocab_size:
            raise CheckpointError(f"{path}: d2t maps draft ids outside the target vocabulary")
        fields["draft_to_target"] = jnp.asarray(ids, jnp.int32)
    return head, HeadParams(**fields)


def save_head(path: str | Path, head: HeadConfig, params: HeadParams) -> Path:
    """Write `params` in the layout `load_head` reads (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lc = head.layer
    cfg: dict[str, Any] = {
        "lithos_draft_head": head.kind,
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_attention_heads": lc.num_heads,
        "num_key_value_heads": lc.num_kv_heads,
        "head_dim": lc.head_dim,
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta,
        "vocab_size": head.vocab_size,
        "draft_vocab_size": head.draft_vocab_size,
        "feature_layers": list(head.feature_layers),
    }
    if lc.rope_scaling is not None:
        s = lc.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": s.kind,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if head.kind == "eagle3":
        cfg["architectures"] = [EAGLE3_ARCHITECTURES[0]]
    tensors = {}
    for name, field in TENSOR_NAMES[head.kind].items():
        value = getattr(params, field)
        if value is not None:
            tensors[name] = np.asarray(value, np.float32)
    if params.draft_to_target is not None:
        ids = np.asarray(params.draft_to_target, np.int64)
        tensors["d2t"] = ids - np.arange(len(ids))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tensors, path / "model.safetensors")
    return path
