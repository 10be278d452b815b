"""Tensor parallelism on 2, 4 and 8 CPU devices: the same greedy tokens and (within float
tolerance) the same logits as one device, for tiny random models and SmolLM2; the collectives of
the compiled decode program counted; the fused kernel path run per device inside shard_map (on a
CPU the kernels' jax.numpy twins run there, in the structure a GPU runs), with its reductions plain
or overlapped; impossible splits refused with errors that say what to do.

jax fixes its device count when it starts, and the rest of the suite runs on one device. So when
this file is collected in a process with fewer than 8 devices, it holds one test that runs the
file again in a fresh process with `--xla_force_host_platform_device_count=8` (a process already
started with 8 or more devices runs the tests directly).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import jax
import pytest

from .conftest import run_on_cpu_devices

DEVICES = 8

if jax.device_count() < DEVICES:

    def test_sharded_suite_in_a_process_with_8_cpu_devices():
        t = time.perf_counter()
        run = run_on_cpu_devices(DEVICES, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", __file__])
        print(run.stdout[-3000:], f"\n(sharded suite: {time.perf_counter() - t:.0f} s)")
        assert run.returncode == 0, f"sharded suite failed:\n{run.stdout[-12000:]}\n{run.stderr[-4000:]}"

else:
    from functools import partial

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import lithos
    from lithos import bench, cli, decode
    from lithos.checkpoint import load_checkpoint
    from lithos.engine import MIN_PROMPT_BUCKET, Model, _bucket
    from lithos.errors import LithosError
    from lithos.kv_cache import init_cache
    from lithos.models import llama
    from lithos.placement import DeviceLayout, collectives, make_mesh, make_placement
    from lithos.sampling import SamplingParams
    from lithos.tensor_parallel import argmax_across_shards

    def prefill(model: Model, ids: list[int]):
        """The model's own prefill program (compiled by generate, so a cache hit) on one prompt, with the
        inputs the engine gives it: returns (decode state, last-position logits `[vocab]`)."""
        tokens = np.zeros((1, _bucket(len(ids), MIN_PROMPT_BUCKET, model.max_len)), np.int32)
        tokens[0, : len(ids)] = ids
        dtype = model.params.embed.dtype
        if model.placement is None:
            c = model.cfg
            cache = init_cache(c.num_layers, 1, c.num_kv_heads, model.max_len, c.head_dim, dtype)
        else:
            cache = model.placement.init_cache(1, model.max_len, dtype)
        program, _ = decode.programs(model.placement)
        state, _, logits = program(
            model.params,
            jnp.asarray(tokens),
            jnp.asarray(np.array([len(ids)], np.int32)),
            cache,
            jnp.asarray(np.array([4], np.int32)),
            jnp.asarray(np.array(model.tokenizer.stop_ids or (-1,), np.int32)),
            SamplingParams.make(),
            jax.random.key(0),
            cfg=model.cfg,
            greedy=True,
        )
        return state, np.asarray(logits[0])

    def decode_collectives(model: Model, state) -> list:
        _, program = decode.programs(model.placement)
        lowered = program.lower(
            model.params,
            state,
            cfg=model.cfg,
            chunk=model.stream_every,
            block=model.block,
            greedy=True,
            kernels=model.kernels,
        )
        return collectives(lowered.compile().as_text())

    def assert_tensor_parallel_collectives(found: list, model: Model, vocab_split: bool) -> None:
        """The plain tensor-parallel decode step (batch 1): two all-reduces of the hidden state in the
        layer loop's body (after wo, after w_down); in the step's body, the embedding lookup over the
        vocab-split table (one all-reduce of the looked-up row per stored plane: one for a dense
        table, data and scales for a packed one) and, for the greedy token, two all-gathers of
        `[1, tp]` (each shard's best logit and its id). Nothing else: no weight is ever gathered."""
        hidden, tp = model.cfg.hidden_size, model.placement.tp
        assert {c.kind for c in found} <= {"all-reduce", "all-gather"}, found
        reduces = [c for c in found if c.kind == "all-reduce"]
        # The projections' reductions, all in one computation: the body of the loop over layers.
        projections = [c for c in reduces if c.op_name.endswith("dot_general")]
        assert Counter(c.computation for c in projections).most_common() == [(projections[0].computation, 2)], found
        assert all(c.elements == hidden and c.type.startswith("f32") for c in projections), projections
        lookup = [c for c in reduces if c not in projections]
        assert {c.computation for c in lookup}.isdisjoint({projections[0].computation}), found
        planes = len(jax.tree_util.tree_leaves(model.params.embed))
        expected_lookup = planes if vocab_split else 0
        assert len(lookup) == expected_lookup and all(c.op_name.endswith("/gather") for c in lookup), lookup
        assert all(c.elements <= hidden for c in lookup), lookup  # a row of the table, never the table
        gathers = [c.elements for c in found if c.kind == "all-gather"]
        assert gathers == ([tp, tp] if vocab_split else []), gathers

    # ---- a tiny random model -----------------------------------------------------------------

    TINY_PROMPT = "The quick brown fox"  # this random Qwen3 answers with varied tokens, not one repeated

    @pytest.fixture(scope="module")
    def tiny(hf_checkpoint):
        """A tiny random Qwen3 (4 heads, 2 KV heads, per-head Q/K norms, untied head, vocab 260) on one
        device: its checkpoint, its greedy tokens and its prompt logits."""
        ckpt = load_checkpoint(hf_checkpoint("qwen3", tied=False), dtype="float32", use_cache=False)
        one = Model(ckpt, max_len=64, stream_every=8, block=4)
        tokens = one.generate(TINY_PROMPT, raw=True, max_new_tokens=12).token_ids
        _, logits = prefill(one, one.prompt_ids(TINY_PROMPT, raw=True))
        return ckpt, tokens, logits

    TINY = [  # (tp, pad_heads): the layout each one exercises
        (2, False),  # KV heads split, vocab split
        (4, False),  # each KV head on two devices, vocab split
        (8, True),  # zero heads added (8 heads, 8 KV heads); vocab 260 replicated (not divisible by 8)
    ]

    @pytest.mark.parametrize("tp, pad_heads", TINY)
    def test_tiny_model_decodes_the_same_split(tiny, tp, pad_heads):
        ckpt, expected, logits_one = tiny
        placement = make_placement(ckpt.cfg, tp, pad_heads=pad_heads)
        split = Model(ckpt, max_len=64, stream_every=8, block=4, placement=placement)
        assert split.params.layers.wq.sharding.spec == P(None, "tp", None)
        assert split.params.layers.w_down.sharding.spec == P(None, None, "tp")
        assert split.generate(TINY_PROMPT, raw=True, max_new_tokens=12).token_ids == expected

        state, logits = prefill(split, split.prompt_ids(TINY_PROMPT, raw=True))
        np.testing.assert_allclose(logits, logits_one, rtol=1e-4, atol=1e-4)
        # The KV cache is split by KV head: each device holds its own heads' keys and values only.
        k = state.cache.k
        assert k.sharding.spec == P(None, None, "tp", None, None)
        assert {s.data.shape[2] for s in k.addressable_shards} == {split.cfg.num_kv_heads // tp}

        vocab_split = ckpt.cfg.vocab_size % tp == 0
        assert_tensor_parallel_collectives(decode_collectives(split, state), split, vocab_split)

        if tp == 2:  # sampling gathers the logits, then draws exactly what one device draws
            one = Model(ckpt, max_len=64, stream_every=8, block=4)
            sampling = dict(raw=True, max_new_tokens=10, temperature=0.9, top_k=40, seed=3)
            assert split.generate("hello", **sampling).token_ids == one.generate("hello", **sampling).token_ids

    # ---- SmolLM2 (packed Q4_1/Q8_0 weights, as it loads by default) --------------------------

    @pytest.fixture(scope="module")
    def smollm2(smollm2_gguf):
        ckpt = load_checkpoint(smollm2_gguf, dtype="float32", use_cache=False)
        one = Model(ckpt, max_len=128, stream_every=4, block=4)
        prompt = "What is the capital of France?"
        result = one.generate(prompt, max_new_tokens=6)
        _, logits = prefill(one, one.prompt_ids(prompt))
        return ckpt, prompt, result.token_ids, logits

    @pytest.mark.slow
    @pytest.mark.parametrize("tp", [2, 4, 8])
    def test_smollm2_decodes_the_same_split(smollm2, tp):
        ckpt, prompt, expected, logits_one = smollm2
        # 9 heads / 3 KV heads split over no tp > 1 without zero heads (see test_impossible_splits).
        placement = make_placement(ckpt.cfg, tp, pad_heads=True)
        model = Model(ckpt, max_len=128, stream_every=4, block=4, placement=placement)
        result = model.generate(prompt, max_new_tokens=6)
        assert result.token_ids == expected
        state, logits = prefill(model, model.prompt_ids(prompt))
        np.testing.assert_allclose(logits, logits_one, rtol=1e-3, atol=1e-3)
        assert_tensor_parallel_collectives(decode_collectives(model, state), model, vocab_split=True)

    # ---- kernels inside shard_map ------------------------------------------------------------

    def test_row_split_kernel_runs_per_shard_with_one_all_reduce():
        """A stand-in for an FFI matvec over a row-split weight (wo: `[hidden, heads*head_dim]`)."""
        cfg = llama.config_from_hf(
            dict(architectures=["LlamaForCausalLM"], num_hidden_layers=1, hidden_size=64, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, intermediate_size=128, vocab_size=256)
        )  # fmt: skip
        placement = make_placement(cfg, 4)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1, 128)).astype(np.float32)  # attention output, [batch, heads*head_dim]
        wo = rng.normal(size=(64, 128)).astype(np.float32)

        def per_shard(x_local, w_local):
            assert x_local.shape == (1, 128 // 4) and w_local.shape == (64, 128 // 4)  # local shapes
            return jax.lax.psum(x_local @ w_local.T, placement.axis)

        in_axes = [("batch", "heads"), ("embed", "heads")]
        matvec = jax.jit(placement.shard_kernel(per_shard, in_axes, ("batch", "embed")))
        x_placed = jax.device_put(x, placement.sharding(("batch", "heads")))
        wo_placed = jax.device_put(wo, placement.sharding(("embed", "heads")))
        np.testing.assert_allclose(matvec(x_placed, wo_placed), x @ wo.T, rtol=1e-5, atol=1e-4)
        found = collectives(matvec.lower(x_placed, wo_placed).compile().as_text())
        assert [(c.kind, c.elements) for c in found] == [("all-reduce", 64)]  # inputs never gathered

    def test_vocab_split_head_and_argmax_per_shard():
        """A stand-in for the fused LM head + argmax kernel over a vocabulary split 8 ways, ties included."""
        cfg = llama.config_from_hf(
            dict(architectures=["LlamaForCausalLM"], num_hidden_layers=1, hidden_size=32, num_attention_heads=8,
                 num_key_value_heads=8, head_dim=4, intermediate_size=64, vocab_size=512)
        )  # fmt: skip
        placement = make_placement(cfg, 8)
        local_vocab = placement.local_cfg.vocab_size
        rng = np.random.default_rng(1)
        h = rng.normal(size=(3, 32)).astype(np.float32)
        head = rng.normal(size=(512, 32)).astype(np.float32)
        head[7] = head[9] = 10 * h[2]  # row 2: a tie within a shard
        head[400] = head[int(np.argmax(h[1] @ head.T))]  # row 1: a tie across shards, the lower id wins

        def per_shard(h, head_local):
            logits = h @ head_local.T  # [batch, vocab / tp]
            local = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            offset = jax.lax.axis_index(placement.axis) * local_vocab
            return argmax_across_shards(jnp.max(logits, axis=-1), local + offset, placement.axis)

        greedy = jax.jit(placement.shard_kernel(per_shard, [("batch", "embed"), ("vocab", "embed")], ("batch",)))
        head_placed = jax.device_put(head, placement.sharding(("vocab", "embed")))
        tokens = np.asarray(greedy(h, head_placed))
        np.testing.assert_array_equal(tokens, np.argmax(h @ head.T, axis=-1))
        assert tokens[2] == 7
        found = collectives(greedy.lower(h, head_placed).compile().as_text())
        assert sorted((c.kind, c.elements) for c in found) == [("all-gather", 3 * 8)] * 2

    # ---- the fused kernel path, per device inside shard_map -------------------------------------

    def assert_per_device_collectives(found: list, hidden: int, tp: int, vocab_split: bool, overlap: bool) -> None:
        """The fused step run per device (batch 1, one token): in the body of the loop over layers, the
        two reductions of the hidden state (plain: two all-reduces of `[1, hidden]`; overlapped: per
        reduction tp - 1 ring hops of `[1, hidden / tp]` and one all-gather of `[1, hidden]`); in the
        step's body, when the vocabulary is split, the embedding lookup's all-reduce of one row and
        the greedy token's two all-gathers of `[1, tp]`. Nothing else: no weight is ever gathered."""
        per_computation: dict[str, Counter] = {}
        for c in found:
            per_computation.setdefault(c.computation, Counter())[(c.kind, c.elements)] += 1
        if overlap:
            layer = Counter({("collective-permute", hidden // tp): 2 * (tp - 1), ("all-gather", hidden): 2})
        else:
            layer = Counter({("all-reduce", hidden): 2})
        step = Counter({("all-reduce", hidden): 1, ("all-gather", tp): 2}) if vocab_split else Counter()
        expected = [layer] + ([step] if step else [])
        assert sorted(map(sorted, per_computation.values())) == sorted(map(sorted, expected)), found

    FUSED_PROMPT = "the quick brown fox"

    @pytest.fixture(scope="module")
    def fused_one(hf_checkpoint):
        """A tiny random Llama the fused kernels take (head_dim 64; 2 heads, 1 KV head, vocab 260) and its
        greedy tokens on one device through the fused path."""
        ckpt = load_checkpoint(hf_checkpoint("llama_hd64"), dtype="float32", use_cache=False)
        one = Model(ckpt, max_len=64, stream_every=8, block=4, kernels="fused")
        tokens = one.generate(FUSED_PROMPT, raw=True, max_new_tokens=12).token_ids
        assert len(set(tokens)) > 3, tokens  # varied tokens, so a wrong split shows
        return ckpt, one, tokens

    FUSED = [  # (tp, pad_heads, overlap): the layout each one exercises
        (2, False, False),  # the KV head on both devices, one query head each; vocab split
        (2, False, True),
        (4, True, True),  # zero query heads added; vocab split 4 ways; three ring hops per reduction
        (8, True, True),  # vocab 260 replicated: the head runs whole on every device, no gathers
    ]

    @pytest.mark.parametrize("tp, pad_heads, overlap", FUSED)
    def test_fused_path_decodes_the_same_per_device(fused_one, tp, pad_heads, overlap):
        ckpt, one, expected = fused_one
        placement = make_placement(ckpt.cfg, tp, pad_heads=pad_heads, overlap=overlap)
        split = Model(ckpt, max_len=64, stream_every=8, block=4, kernels="fused", placement=placement)
        assert split.generate(FUSED_PROMPT, raw=True, max_new_tokens=12).token_ids == expected
        state, _ = prefill(split, split.prompt_ids(FUSED_PROMPT, raw=True))
        vocab_split = ckpt.cfg.vocab_size % tp == 0
        found = decode_collectives(split, state)
        assert_per_device_collectives(found, split.cfg.hidden_size, tp, vocab_split, overlap)
        if (tp, overlap) == (2, True):  # sampling reads the logits split over the vocabulary
            sampling = dict(raw=True, max_new_tokens=10, temperature=0.9, top_k=40, seed=3)
            assert split.generate("hello", **sampling).token_ids == one.generate("hello", **sampling).token_ids

    @pytest.mark.parametrize("arch", ["qwen3_hd64", "qwen2_hd64", "llama_bias_hd64"])
    def test_fused_norms_and_biases_decode_the_same_per_device(hf_checkpoint, arch):
        """Qwen3's per-head Q/K norms, Qwen2's Q/K/V biases and an output-projection bias on the fused path split over
        2 devices: the same sampled tokens, so the same logits (greedy decoding's split argmax is
        test_fused_path_decodes_the_same_per_device's; each decoding mode compiles programs of its own)."""
        ckpt = load_checkpoint(hf_checkpoint(arch), dtype="float32", use_cache=False)
        one = Model(ckpt, max_len=64, stream_every=8, block=4, kernels="fused")
        split = Model(ckpt, max_len=64, stream_every=8, block=4, kernels="fused", placement=make_placement(ckpt.cfg, 2))
        sampled = dict(raw=True, max_new_tokens=12, temperature=0.9, seed=3)  # varied tokens: a wrong split shows
        expected = one.generate(FUSED_PROMPT, **sampled).token_ids
        assert len(set(expected)) > 3, expected
        assert split.generate(FUSED_PROMPT, **sampled).token_ids == expected

    def test_fused_step_with_split_kv_heads_matches_one_device():
        """8 heads over 4 KV heads at tp=4, reductions overlapped: each device holds a KV head of its
        own (none repeated). The per-device logits and greedy token of a step after a 6-token prefill
        match one device's."""
        tp, overlap = 4, True
        cfg = llama.config_from_hf(
            dict(architectures=["LlamaForCausalLM"], num_hidden_layers=2, hidden_size=128, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, intermediate_size=256, vocab_size=512)
        )  # fmt: skip
        rng = np.random.default_rng(2)
        params = llama.params_from_flat(
            {name: rng.normal(size=shape).astype(np.float32) / 8 for name, shape in llama.param_shapes(cfg).items()}
        )
        tokens, positions = jnp.array([[5, 17, 3, 60, 22, 9, 301]]), jnp.arange(7)[None]

        def step(params, cache, cfg, placement):
            _, cache = jax.jit(partial(llama.forward, cfg=cfg))(params, tokens[:, :6], positions[:, :6], cache)
            fused = dict(cfg=cfg, kernels="fused", placement=placement)
            logits, _ = jax.jit(partial(llama.forward, **fused))(params, tokens[:, 6:], positions[:, 6:], cache)
            argmax = jax.jit(partial(llama.forward_argmax, **fused))
            token, _ = argmax(params, tokens[:, 6:], positions[:, 6:], cache)
            hlo = argmax.lower(params, tokens[:, 6:], positions[:, 6:], cache).compile().as_text()
            return np.asarray(logits), np.asarray(token), collectives(hlo)

        one_cache = init_cache(2, 1, 4, 16, 64, jnp.float32)
        logits_one, token_one, _ = step(jax.tree_util.tree_map(jnp.asarray, params), one_cache, cfg, None)
        placement = make_placement(cfg, tp, overlap=overlap)
        assert placement.heads.identity and placement.local_cfg.num_kv_heads == 4 // tp
        placed = placement.put_params(params)
        logits, token, found = step(placed, placement.init_cache(1, 16, jnp.float32), placement.cfg, placement)
        np.testing.assert_allclose(logits, logits_one, rtol=1e-5, atol=1e-5)
        assert token.tolist() == token_one.tolist() == [[int(np.argmax(logits_one[0, 0]))]]
        assert_per_device_collectives(found, cfg.hidden_size, tp, vocab_split=True, overlap=overlap)

    def test_bench_times_the_overlapped_reduction_beside_the_plain_one(tmp_path, monkeypatch):
        """`lithos bench --tp 2 --tp-overlap` on a tiny shape: fused and fused+overlap rows, side by side."""
        models = tmp_path / "configs" / "models"
        models.mkdir(parents=True)
        (tmp_path / "configs" / "hardware").mkdir()
        shape = dict(architectures=["LlamaForCausalLM"], num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, intermediate_size=256, vocab_size=512)  # fmt: skip
        (models / "tiny.json").write_text(json.dumps(shape))
        argv = ["bench", "--shape", "tiny", "--tp", "2", "--tp-overlap", "--kernels", "fused",
                "--context", "32", "--steps", "16", "--loops", "2", "--runs", "4", "--bandwidth-bytes", str(1 << 22),
                "--out", str(tmp_path / "out")]  # fmt: skip
        monkeypatch.setenv("LITHOS_CONFIGS", str(tmp_path / "configs"))
        result = bench.run(cli.build_parser().parse_args(argv), argv[1:])
        rows = result["rows"]
        assert [(r["model"], r["kernels"], r["tp"]) for r in rows] == [
            ("tiny-tp2", "fused", 2),
            ("tiny-tp2", "fused+overlap", 2),
        ]
        assert all(r["step_ms"] > 0 for r in rows)
        with pytest.raises(LithosError, match="--tp-overlap .* --tp 2"):
            bench.run(cli.build_parser().parse_args(argv[:3] + ["--tp-overlap", "--kernels", "fused"]))

    # ---- errors ------------------------------------------------------------------------------

    def smollm2_shape(**overrides) -> llama.Config:
        hf = dict(
            architectures=["LlamaForCausalLM"], num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
        )  # fmt: skip
        return llama.config_from_hf(hf | overrides)

    def test_impossible_splits_name_the_fix():
        with pytest.raises(LithosError, match=r"9 attention heads \(3 KV heads\) do not split over tp=2: choose --tp "
                           r"from \[1\], or pass pad_heads=True \(--pad-heads\).*12 heads, 33% more"):  # fmt: skip
            make_placement(smollm2_shape(), 2)
        with pytest.raises(LithosError, match=r"FFN width 100 does not split over tp=8: choose --tp from \[1, 2, 4\]"):
            make_placement(smollm2_shape(num_attention_heads=8, num_key_value_heads=8, intermediate_size=100), 8)
        with pytest.raises(LithosError, match=r"tp=3 does not divide the 8 devices.*\[1, 2, 4, 8\]"):
            make_placement(smollm2_shape(), 3, pad_heads=True)
        with pytest.raises(LithosError, match=r"tp=16 needs 16 devices but jax sees 8.*device_count=16"):
            make_placement(smollm2_shape(), 16, pad_heads=True)
        with pytest.raises(LithosError, match=r"not a whole number of GPUs at 3 logical devices per GPU"):
            make_mesh(2, DeviceLayout(3))
        with pytest.raises(LithosError, match=r"tp=3 would split a GPU's 2 logical devices"):
            make_mesh(3, DeviceLayout(2), devices=jax.devices()[:6])

    def test_dpx_pairs_the_dies_of_one_gpu():
        placement = make_placement(smollm2_shape(num_attention_heads=8, num_key_value_heads=2), 2, DeviceLayout(2))
        assert [d.id for d in placement.mesh.devices.flat] == [0, 1]  # GPU 0's two dies
        assert "2 logical devices per GPU" in placement.describe()

    def test_overlap_is_refused_where_it_means_nothing(tiny, hf_checkpoint, capsys):
        ckpt = tiny[0]
        with pytest.raises(LithosError, match="overlap=True schedules the fused kernels.*kernels='fused'"):
            Model(ckpt, placement=make_placement(ckpt.cfg, 2, overlap=True))
        with pytest.raises(LithosError, match="overlap=True .* pass tp > 1"):
            lithos.load(hf_checkpoint("llama_hd64"), overlap=True)
        with pytest.raises(LithosError, match=r"hidden state \(580\) into tp=8 chunks.*--tp-overlap"):
            make_placement(smollm2_shape(hidden_size=580), 8, pad_heads=True, overlap=True)
        path = hf_checkpoint("llama_hd64")
        argv = ["generate", "hi", "--raw", "--model", str(path), "--dtype", "float32", "--tp", "2", "--tp-overlap"]
        assert cli.main(argv) == 2  # the reference path (the default) has no overlapped schedule
        assert capsys.readouterr().err.startswith("lithos: error: overlap=True schedules the fused kernels")

    def test_cli_tp_error_is_one_line(hf_checkpoint, capsys):
        path = hf_checkpoint("qwen3", tied=False)
        argv = ["generate", "hi", "--raw", "--model", str(path), "--dtype", "float32", "--tp", "3"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("lithos: error: tp=3 does not divide the 8 devices") and "Traceback" not in err
