"""Speculative sampling is lossless: what it emits is distributed exactly as the target's samples.

On a model with a 4-token vocabulary, 10,000 seeded rows each sample 4 tokens after a fixed prompt
(the first from prefill, the rest from rounds of k=2 drafts, so accepted drafts, corrections and
bonus tokens all occur). The joint distribution of the 4 tokens (256 cells) is computed exactly from
the target's logits and compared by a chi-square test. The threshold is the 0.999 quantile: a correct
sampler fails by chance once in a thousand seeds (the seeds are fixed, so never unless the code
changes). A verifier with a classic mistake (sampling the target itself after a rejection instead
of the residual max(p - q, 0)) must fail the same test.
"""

from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.kv_cache import init_cache
from lithos.models import llama
from lithos.sampling import SamplingParams, filter_logits
from lithos.spec import DraftModelDrafter, NGramDrafter, loop, verify

VOCAB, NEW_TOKENS, K, ROWS = 4, 4, 2, 10_000
PROMPT = [1, 2, 3]
ALPHA = 1e-3
CFG = llama.Config(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _params(seed: int, scale: float) -> llama.Params:
    params = llama.init_params(CFG, jax.random.key(seed), jnp.float32)
    # A larger LM head gives peaked, dissimilar distributions: the verifier's choices then matter.
    return params.replace(lm_head=params.lm_head * scale)


TARGET = _params(0, 4.0)
DRAFT = _params(1, 4.0)


def spec_samples(drafter, draft_params, sampling: SamplingParams, seed: int, chunk_program=None) -> np.ndarray:
    """`[ROWS, NEW_TOKENS]` tokens sampled speculatively, one row per independent request."""
    chunk_program = chunk_program or loop.spec_chunk
    tokens = jnp.tile(jnp.array([PROMPT + [0]], jnp.int32), (ROWS, 1))
    cache = init_cache(CFG.num_layers, ROWS, CFG.num_kv_heads, 16, CFG.head_dim, jnp.float32)
    state, first = loop.spec_prefill(
        TARGET,
        draft_params,
        tokens,
        jnp.full((ROWS,), len(PROMPT), jnp.int32),
        cache,
        jnp.full((ROWS,), NEW_TOKENS, jnp.int32),
        jnp.array([-1], jnp.int32),
        sampling,
        jax.random.key(seed),
        cfg=CFG,
        drafter=drafter,
        k=K,
        greedy=False,
    )
    state, out = chunk_program(
        TARGET, draft_params, state, cfg=CFG, drafter=drafter, k=K, chunk=8, block=1, greedy=False
    )
    assert bool(jnp.all(state.done))
    samples = np.concatenate([np.asarray(first)[:, None], np.asarray(out)[:, : NEW_TOKENS - 1]], axis=1)
    assert (samples >= 0).all()
    return samples


def target_joint(sampling: SamplingParams) -> np.ndarray:
    """Exact probability of every sequence of NEW_TOKENS tokens `[VOCAB] * NEW_TOKENS` under the target."""
    prefixes = list(itertools.product(range(VOCAB), repeat=NEW_TOKENS - 1))
    tokens = jnp.array([PROMPT + list(p) for p in prefixes], jnp.int32)
    cache = init_cache(CFG.num_layers, len(prefixes), CFG.num_kv_heads, 16, CFG.head_dim, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = jax.jit(partial(llama.forward, cfg=CFG))(TARGET, tokens, positions, cache)
    probs = np.asarray(jax.nn.softmax(filter_logits(logits[:, len(PROMPT) - 1 :], sampling), axis=-1), np.float64)
    joint = np.zeros((VOCAB,) * NEW_TOKENS)
    for row, prefix in enumerate(prefixes):
        p = 1.0
        for i, token in enumerate(prefix):
            p *= probs[row, i, token]
        joint[prefix] = p * probs[row, NEW_TOKENS - 1]
    return joint


def chi_square_p_value(samples: np.ndarray, joint: np.ndarray) -> float:
    """p-value of Pearson's chi-square test; cells expecting fewer than 5 draws are pooled."""
    counts = np.zeros(joint.shape, int)
    np.add.at(counts, tuple(samples.T), 1)
    impossible = joint == 0
    assert counts[impossible].sum() == 0, "a token outside the filtered distribution was emitted"
    expected = joint * len(samples)
    small = (expected < 5) & ~impossible
    obs = np.append(counts[~small & ~impossible], counts[small].sum())
    exp = np.append(expected[~small & ~impossible], expected[small].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(jax.scipy.special.gammaincc(dof / 2, stat / 2))


def wrong_verify_sampling(target_logits, draft_tokens, draft_probs, sampling, key):
    """A verifier with a classic bug: after a rejection it samples p instead of max(p - q, 0)."""
    batch, k = draft_tokens.shape
    key_accept, key_extra = jax.random.split(key)
    p = jax.nn.softmax(filter_logits(target_logits, sampling), axis=-1)
    q = draft_probs if draft_probs is not None else jax.nn.one_hot(draft_tokens, p.shape[-1])
    p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    accepted = verify.accepted_prefix(jax.random.uniform(key_accept, (batch, k)) * q_draft < p_draft)
    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    extra = jax.random.categorical(key_extra, jnp.log(p_at), axis=-1).astype(jnp.int32)
    tokens = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    return accepted, jnp.where(jnp.arange(k + 1)[None] == accepted[:, None], extra[:, None], tokens)


DRAFT_MODEL = DraftModelDrafter(CFG, VOCAB)


@pytest.mark.parametrize(
    "drafter, draft_params, sampling",
    [
        (DRAFT_MODEL, DRAFT, SamplingParams.make(temperature=1.0)),
        (DRAFT_MODEL, DRAFT, SamplingParams.make(temperature=0.8, top_k=3)),
        (NGramDrafter(max_ngram=2), None, SamplingParams.make(temperature=1.0)),
    ],
    ids=["draft-model", "draft-model-top-k", "ngram-one-hot-q"],
)
def test_speculative_samples_follow_the_target(drafter, draft_params, sampling):
    p_value = chi_square_p_value(spec_samples(drafter, draft_params, sampling, seed=11), target_joint(sampling))
    assert p_value > ALPHA, f"chi-square p-value {p_value:.2e}: the output distribution is not the target's"


def test_wrong_verifier_fails(monkeypatch):
    """The test has the power to see a verifier's mistake."""
    sampling = SamplingParams.make(temperature=1.0)
    monkeypatch.setattr(verify, "verify_sampling", wrong_verify_sampling)

    # A new function object, so jax traces it afresh with the wrong verifier (traces are cached per
    # function) and the shared program keeps its own.
    def retraced(*args, **kwargs):
        return loop.spec_chunk.__wrapped__(*args, **kwargs)

    chunk = jax.jit(retraced, static_argnames=("cfg", "drafter", "k", "chunk", "block", "greedy", "kernels"))
    samples = spec_samples(DRAFT_MODEL, DRAFT, sampling, seed=11, chunk_program=chunk)
    p_value = chi_square_p_value(samples, target_joint(sampling))
    assert p_value < ALPHA, f"the wrong verifier passed (p-value {p_value:.3f})"


def test_verifier_first_token_marginal_is_p():
    """Function level: whatever q proposes, the first emitted token is distributed as p."""
    p_logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    q = jnp.array([0.05, 0.15, 0.3, 0.5])
    n = 50_000
    key_draft, key_verify = jax.random.split(jax.random.key(3))
    drafts = jax.random.categorical(key_draft, jnp.log(q), shape=(n, 1)).astype(jnp.int32)
    logits = jnp.broadcast_to(p_logits, (n, 2, 4))
    probs = jnp.broadcast_to(q, (n, 1, 4))
    sampling = SamplingParams.make(temperature=1.0)
    accepted, tokens = jax.jit(verify.verify_sampling)(logits, drafts, probs, sampling, key_verify)
    first = np.asarray(tokens[:, 0])
    counts = np.bincount(first, minlength=4)
    expected = np.array([0.5, 0.3, 0.15, 0.05]) * n
    stat = ((counts - expected) ** 2 / expected).sum()
    assert stat < 16.27, (counts, expected)  # chi-square, 3 degrees of freedom, 0.999 quantile
    # Acceptance rate is sum(min(p, q)) = 0.05 + 0.15 + 0.15 + 0.05.
    assert abs(float(jnp.mean(accepted)) - 0.4) < 0.01
