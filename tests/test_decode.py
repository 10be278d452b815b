"""The decode program: on-device loop against a step-by-step reference, compile counts, batching,
stopping, seeded sampling."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import decode
from lithos.errors import CacheFullError, LithosError
from lithos.kv_cache import init_cache
from lithos.models import family_of
from lithos.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(hf_checkpoint):
    return lithos.load(hf_checkpoint("llama3", tied=True), dtype="float32", max_len=128, stream_every=8, block=4)


def stepwise_greedy(model, ids: list[int], n: int) -> list[int]:
    """The plainest possible decode: one jitted forward per token, argmax on the host."""
    cfg = model.cfg
    forward = jax.jit(partial(family_of(cfg).forward, cfg=cfg))
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, model.max_len, cfg.head_dim, jnp.float32)
    logits, cache = forward(model.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], cache)
    out = [int(np.argmax(logits[0, -1]))]
    for i in range(n - 1):
        pos = len(ids) + i
        logits, cache = forward(model.params, jnp.asarray([[out[-1]]]), jnp.array([[pos]]), cache)
        out.append(int(np.argmax(logits[0, 0])))
    return out


def test_device_loop_equals_stepwise_reference(tiny):
    ids = tiny.prompt_ids("hello there", raw=True)
    result = tiny.generate("hello there", raw=True, max_new_tokens=40)
    expected = stepwise_greedy(tiny, ids, len(result.token_ids))
    assert result.token_ids == expected
    # The tiny random model never says its stop token by chance often; if it did, it ended there.
    assert result.finish_reason in ("length", "stop")
    if result.finish_reason == "length":
        assert len(result.token_ids) == 40


def test_compiles_once_per_bucket(tiny):
    tiny.generate("warm up", raw=True, max_new_tokens=5)
    prefill_compiles = decode.prefill._cache_size()
    chunk_compiles = decode.decode_chunk._cache_size()
    # Different prompt lengths in one bucket (<= 16 tokens) and different token budgets: no new programs.
    for prompt, n in [("a", 3), ("abcdefgh", 17), ("abcdefghijk", 9)]:
        tiny.generate(prompt, raw=True, max_new_tokens=n)
    assert decode.prefill._cache_size() == prefill_compiles
    assert decode.decode_chunk._cache_size() == chunk_compiles
    # A longer prompt is a new bucket: exactly one more prefill program, same decode program.
    tiny.generate("x" * 30, raw=True, max_new_tokens=4)
    assert decode.prefill._cache_size() == prefill_compiles + 1
    assert decode.decode_chunk._cache_size() == chunk_compiles


def test_batch_rows_of_different_lengths_match_single_requests(tiny):
    prompts = ["one", "a somewhat longer prompt here", "mid length", "x"]
    batch = tiny.generate_batch(prompts, raw=True, max_new_tokens=12)
    for prompt, got in zip(prompts, batch):
        alone = tiny.generate(prompt, raw=True, max_new_tokens=12)
        assert got.token_ids == alone.token_ids
        assert got.prompt_tokens == alone.prompt_tokens


def test_max_new_tokens_is_exact(tiny):
    for n in (1, 2, 7, 8, 9):
        r = tiny.generate("count", raw=True, max_new_tokens=n)
        assert len(r.token_ids) <= n
        if r.finish_reason == "length":
            assert len(r.token_ids) == n


def test_stops_on_stop_token(tiny):
    """Make the stop set contain whatever greedy produces third: generation must end right there."""
    free = tiny.generate("stop here", raw=True, max_new_tokens=10).token_ids
    stop_token = free[2]
    first = free.index(stop_token)
    original = tiny.tokenizer.stop_ids
    tiny.tokenizer.stop_ids = (stop_token,)
    try:
        r = tiny.generate("stop here", raw=True, max_new_tokens=10)
    finally:
        tiny.tokenizer.stop_ids = original
    assert r.token_ids == free[: first + 1]
    assert r.finish_reason == "stop"


def test_sampling_is_seeded_and_reproducible(tiny):
    kw = dict(raw=True, max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95)
    a = tiny.generate("sample me", seed=3, **kw).token_ids
    b = tiny.generate("sample me", seed=3, **kw).token_ids
    c = tiny.generate("sample me", seed=4, **kw).token_ids
    assert a == b
    assert a != c


def test_cache_full_stops_cleanly(hf_checkpoint):
    model = lithos.load(hf_checkpoint("llama3", tied=True), dtype="float32", max_len=32, stream_every=8, block=4)
    r = model.generate("0123456789", raw=True, max_new_tokens=100)
    assert r.finish_reason == "cache_full"
    # 32 slots hold the prompt and every generated token but the last, which is never fed back.
    assert r.prompt_tokens + len(r.token_ids) == 32 + 1


def test_prompt_longer_than_cache_is_a_clear_error(hf_checkpoint):
    model = lithos.load(hf_checkpoint("llama3", tied=True), dtype="float32", max_len=32)
    with pytest.raises(CacheFullError, match=r"prompt has 40 tokens but the cache holds 32.*max_len"):
        model.generate("x" * 40, raw=True)


def test_streaming_yields_the_same_text(tiny):
    stream = tiny.stream("stream this", raw=True, max_new_tokens=20)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text
    assert stream.result.token_ids == tiny.generate("stream this", raw=True, max_new_tokens=20).token_ids


def test_chat_prompt_uses_template(tiny):
    ids = tiny.prompt_ids([{"role": "user", "content": "hi"}])
    assert (
        tiny.tokenizer.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(LithosError, match="role"):
        tiny.prompt_ids([{"role": "wizard", "content": "hi"}])


def test_only_sampling_steps_draw_from_the_key(tiny):
    """A greedy step keeps the key as it is (no split on the device each step); a sampled one moves it on."""
    ids = np.asarray([tiny.prompt_ids("key", raw=True)], np.int32)
    inputs = (ids, np.array([ids.shape[1]], np.int32), np.array([8], np.int32), np.array([-1], np.int32))
    for greedy, moves in ((True, False), (False, True)):
        state, _ = tiny._prefill(*inputs, SamplingParams.make(temperature=0.0 if greedy else 0.8), greedy=greedy)
        key = np.asarray(jax.random.key_data(state.rng))
        after, _ = decode.decode_step(tiny.params, state, tiny.cfg, greedy, "reference")
        assert (not np.array_equal(np.asarray(jax.random.key_data(after.rng)), key)) == moves
