"""Text <-> token ids for a checkpoint: encoding, decoding, streaming detokenization, chat templates.

One `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend) built either from a Hugging Face
directory (`tokenizer.json` and its config files) or from a GGUF file's `tokenizer.ggml.*` metadata.
The GGUF path rebuilds the tokenizer the way transformers does (integrations/gguf/
gguf_tokenizer_mapping.py), so that the ids match transformers, which is our numerical oracle.
Chat templates are rendered with jinja2 in the same sandboxed environment transformers'
`apply_chat_template` uses, so prompts are byte-identical to the reference.

transformers is not imported here: the device machine and notebooks only need `tokenizers` and
`jinja2`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from lithos.errors import CheckpointError, LithosError

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
_EXAMPLE_MESSAGE = "{'role': 'user', 'content': '...'}"

# Tokens that end an assistant turn in the chat formats we know. llama.cpp keeps a similar list
# (its "end of generation" tokens); a checkpoint's eos alone misses e.g. Llama 3's <|eot_id|> when
# the eos is <|end_of_text|>. <|endoftext|> is deliberately absent: it ends a document, not a turn,
# and counts only when the checkpoint names it as its eos.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|end_of_turn|>",
)

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, copied from transformers'
# GGUF_PRE_TOKENIZER_SPLITS. Names not listed keep the GPT-2 regex of `pre_tokenizers.ByteLevel`, as
# in transformers (e.g. SmolLM2's "smollm"; llama.cpp itself splits digits singly there).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

# Sentencepiece GGUFs of these architectures need builders transformers has and we have not ported
# (Gemma respells whitespace tokens, Phi-3 prefixes spaces with a normalizer); a plain Llama build
# would give different ids, so we refuse them.
_UNPORTED_SENTENCEPIECE_ARCHS = ("gemma", "gemma2", "gemma3", "gemma4", "phi3")

_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _generate_merges(vocab: dict[str, int], vocab_scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary, best first (transformers' `generate_merges`).

    Every split of a token into two vocabulary pieces is a merge ranked by the whole token's score.
    """
    merges = []
    for merge, piece_score in vocab_scores.items():
        local = []
        for index in range(1, len(merge)):
            piece_l, piece_r = merge[:index], merge[index:]
            if piece_l in vocab and piece_r in vocab:
                local.append((piece_l, piece_r, piece_score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda val: (val[2], len(val[0]), len(val[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _gguf_merges(meta: Mapping[str, Any], tokens: list[str]) -> list[tuple[str, str]]:
    """The file's merges, or (older sentencepiece GGUFs carry none) those its scores imply."""
    if "tokenizer.ggml.merges" in meta:
        return [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    if "tokenizer.ggml.scores" not in meta:
        raise CheckpointError(
            "the GGUF tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores, so its BPE "
            "merges cannot be recovered: re-convert the model with a current llama.cpp convert_hf_to_gguf.py"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    return _generate_merges(vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=False)))


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): re-download or re-save the checkpoint") from err


def _as_id_list(value: Any) -> list[int]:
    """An `eos_token_id` field from config.json / generation_config.json: int, list of ints, or null."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """A chat template called raise_exception(message): the conversation is invalid for this model."""


class _GenerationBlock(jinja2.ext.Extension):
    """Parses `{% generation %}...{% endgeneration %}` and renders the body unchanged.

    transformers registers an extension for this tag (to build assistant masks); without one, the
    templates that use it do not even parse.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing underscore names as transformers' sandbox does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's built-in tojson HTML-escapes; chat templates expect plain JSON, as in transformers.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment (sandboxed, trim/lstrip blocks, same globals)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise CheckpointError(
            f"the checkpoint's chat template does not parse (line {err.lineno}: {err.message}); "
            "fix the template or pass raw prompts (--raw)"
        ) from err


def _plain(value: Any) -> Any:
    """A copy of template input made of plain JSON types, so the template cannot edit or escape it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy / jax scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


# Names a message's reasoning is passed under; transformers copies the first one found to
# `reasoning_content` and `thinking` so that templates reading either see it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _check_messages(messages: Any) -> list[dict]:
    """Validate a conversation; return a plain copy without None-valued keys (as transformers does)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise LithosError(f"a chat is a list of message dicts like {_EXAMPLE_MESSAGE}, got {type(messages).__name__}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise LithosError(f"chat message {index} is a {type(message).__name__}, not a dict like {_EXAMPLE_MESSAGE}")
        role = message.get("role")
        if role not in ALLOWED_ROLES:
            raise LithosError(f"chat message {index} has role {role!r}; allowed roles are {', '.join(ALLOWED_ROLES)}")
        content = message.get("content")
        # An assistant turn that only calls tools legitimately has no content.
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise LithosError(f"chat message {index} ({role}) has no 'content': give it the message text")
        if content is not None and not isinstance(content, (str, list)):
            raise LithosError(
                f"chat message {index} ({role}) has content of type {type(content).__name__}; "
                "use a string (or a list of content blocks)"
            )
        plain = {key: value for key, value in _plain(dict(message)).items() if value is not None}
        reasoning = next((plain[key] for key in _REASONING_FIELDS if plain.get(key) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        checked.append(plain)
    return checked


class StreamDecoder:
    """Incremental detokenizer: turns token ids, pushed as they are generated, into text.

    The concatenation of everything `push` and `flush` return equals `Tokenizer.decode` of all the
    ids pushed. Text is held back while it ends in an incomplete UTF-8 character (byte-level BPE
    and byte-fallback tokens can split one character over several tokens).

    It decodes a sliding window `ids[anchor:]` and emits what it adds beyond `ids[anchor:read]`, the
    part already emitted. The anchor is always a token that decodes the same alone as in context:
    not a (possibly skipped) special token, whose absence would let a decoder strip the next
    token's leading space, and not a byte-fallback token, which decodes differently when its byte
    run is cut. (One case cannot match: a byte-fallback run that turns invalid after a valid
    character was already emitted; whole-sequence decoding then blanks the whole run.)
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        special_ids: frozenset[int],
        byte_ids: frozenset[int],
        skip_special_tokens: bool,
    ) -> None:
        self._backend = backend
        self._byte_ids = byte_ids
        self._special_ids = special_ids
        self._unanchored_ids = special_ids | byte_ids
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._anchor = 0  # window start
        self._read = 0  # ids[:read] are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, ids: int | Iterable[int]) -> str:
        """Append token ids (one int, or any iterable of ints, e.g. a numpy row) and return the newly
        completed text, possibly ''."""
        try:
            new_ids = [int(i) for i in ids]
        except TypeError:  # a single id: int, numpy or jax scalar
            new_ids = [int(ids)]
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD) and reset."""
        text = self._emit(final=True)
        self._ids, self._anchor, self._read = [], 0, 0
        return text

    def _last_decoded_id(self) -> int | None:
        """The last pushed id the decoder sees (skipped special tokens do not end a byte run)."""
        for index in reversed(self._ids):
            if not (self._skip_special_tokens and index in self._special_ids):
                return index
        return None

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._anchor : self._read])
        text = self._decode(self._ids[self._anchor :])
        # A trailing U+FFFD is (almost always) a character whose remaining bytes are still to come.
        # A trailing byte-fallback token may be followed by more of its run, and the decoder blanks a
        # whole run that is invalid anywhere: wait until the run ends.
        if not final and (text.endswith("\ufffd") or self._last_decoded_id() in self._byte_ids):
            return ""
        if not text.startswith(emitted):
            # Should not happen with the anchors we choose; fall back to decoding everything.
            emitted = self._decode(self._ids[: self._read])
            text = self._decode(self._ids)
        self._read = len(self._ids)
        for index in range(self._read - 1, self._anchor, -1):
            if self._ids[index] not in self._unanchored_ids:
                self._anchor = index
                break
        return text[len(emitted) :]


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, stop tokens, chat template.

    Build it with `Tokenizer.from_dir` (a Hugging Face directory) or `Tokenizer.from_gguf_metadata`.
    Attributes:
      vocab_size: number of ids the tokenizer can produce (model vocabulary plus added tokens).
      bos_id, eos_id: the checkpoint's beginning/end-of-sequence ids, or None.
      stop_ids: ids that end generation: the eos ids plus end-of-turn tokens the vocabulary defines.
      add_bos: whether `encode(..., add_special_tokens=True)` prepends bos_id.
      chat_template: the jinja source of the chat template, or None.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool = False,
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """Wrap `backend`. Prefer the `from_*` constructors.

        `extra_eos_ids` are further ids the checkpoint declares as ends (generation_config.json, GGUF
        eot/eom ids); `special_tokens` maps template variable names (bos_token, eos_token, ...) to text.
        """
        # Ids must never be cut or padded behind our back (tokenizer.json may carry either setting).
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos) and bos_id is not None
        self.add_eos = bool(add_eos) and eos_id is not None
        self.chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})

        added = backend.get_added_tokens_decoder()
        special_ids = {index for index, token in added.items() if token.special}
        stops = [eos_id] if eos_id is not None else []
        stops += [int(i) for i in extra_eos_ids]
        for text in END_OF_TURN_TOKENS:
            index = backend.token_to_id(text)
            # Only when the vocabulary marks it special: a plain-text "<|end|>" is not a turn marker.
            if index is not None and index in special_ids:
                stops.append(index)
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in stops if 0 <= i < self.vocab_size))

        self._special_ids = frozenset(special_ids)
        # "<0xE6>" is a byte only to a model that falls back to bytes; elsewhere it is ordinary text.
        byte_fallback = getattr(backend.model, "byte_fallback", False)
        self._byte_ids = frozenset(
            index for token, index in backend.get_vocab().items() if byte_fallback and _BYTE_FALLBACK_TOKEN.match(token)
        )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory.

        Reads tokenizer.json (required), tokenizer_config.json (chat_template, bos/eos tokens,
        add_bos_token/add_eos_token), chat_template.jinja (preferred over the config's template, as in
        transformers), and eos ids from generation_config.json and config.json when present.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"no tokenizer.json in {path}: lithos needs the fast-tokenizer file; create it with "
                "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust side raises plain Exception
            raise CheckpointError(f"cannot read {tokenizer_file}: {err}") from err
        tok_config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        special_tokens = {}
        for name in (
            "bos_token",
            "eos_token",
            "unk_token",
            "sep_token",
            "pad_token",
            "cls_token",
            "mask_token",
        ):
            content = _token_content(tok_config.get(name))
            if content is not None:
                special_tokens[name] = content

        def id_of(name: str, config_key: str) -> int | None:
            if name in special_tokens and backend.token_to_id(special_tokens[name]) is not None:
                return backend.token_to_id(special_tokens[name])
            ids = _as_id_list(gen_config.get(config_key)) or _as_id_list(model_config.get(config_key))
            return ids[0] if ids else None

        bos_id = id_of("bos_token", "bos_token_id")
        eos_id = id_of("eos_token", "eos_token_id")
        # generation_config.json lists every id generate() stops on; config.json is its fallback.
        config_eos = gen_config if "eos_token_id" in gen_config else model_config
        extra_eos = _as_id_list(config_eos.get("eos_token_id"))

        # transformers rebuilds the post-processor from add_bos_token/add_eos_token when the config sets
        # either (or tokenizer.json has none); otherwise tokenizer.json's post-processor decides. We add
        # BOS/EOS ourselves, so read that post-processor's behaviour off a probe encoding.
        if "add_bos_token" in tok_config or "add_eos_token" in tok_config or backend.post_processor is None:
            add_bos = bool(tok_config.get("add_bos_token", False))
            add_eos = bool(tok_config.get("add_eos_token", False))
        else:
            plain = backend.encode("a", add_special_tokens=False).ids
            full = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and len(full) > len(plain) and full[0] == bos_id
            add_eos = eos_id is not None and len(full) > len(plain) and full[-1] == eos_id

        chat_template = tok_config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {entry.get("name"): entry.get("template") for entry in chat_template}
            chat_template = named.get("default")
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")

        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=add_bos,
            add_eos=add_eos,
            extra_eos_ids=extra_eos,
            chat_template=chat_template,
            special_tokens=special_tokens,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes, id-for-id as transformers builds it.

        `meta` maps GGUF keys to values as `GGUFReader(path).fields[key].contents()` returns them.
        Supports `tokenizer.ggml.model` 'gpt2' (byte-level BPE) and 'llama' (sentencepiece BPE with
        byte fallback); anything else raises CheckpointError.
        """
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CheckpointError("the GGUF has no tokenizer.ggml.tokens: it carries no tokenizer to run with")
        tokens = [str(t) for t in tokens]
        token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or ()]
        arch = meta.get("general.architecture")
        if model == "gpt2":
            backend, named_defaults = _byte_level_backend(meta, tokens), ("<|endoftext|>",)
            add_bos_default = False
        elif model == "llama":
            if arch in _UNPORTED_SENTENCEPIECE_ARCHS:
                raise CheckpointError(
                    f"GGUF tokenizers of architecture {arch!r} need a special sentencepiece build that "
                    "lithos does not implement: load the model from its Hugging Face directory instead"
                )
            backend, named_defaults = _sentencepiece_backend(meta, tokens), ("<unk>", "<s>", "</s>")
            # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
            add_bos_default = True
        else:
            raise CheckpointError(
                f"the GGUF's tokenizer type (tokenizer.ggml.model) is {model!r}; lithos supports 'gpt2' "
                "(byte-level BPE) and 'llama' (sentencepiece BPE): load the model from its Hugging Face "
                "directory instead"
            )

        def token_of(key: str) -> tuple[int | None, str | None]:
            index = meta.get(f"tokenizer.ggml.{key}")
            if index is None or not 0 <= int(index) < len(tokens):
                return None, None
            return int(index), tokens[int(index)]

        bos_id, bos_text = token_of("bos_token_id")
        eos_id, eos_text = token_of("eos_token_id")
        named = {
            "bos_token": bos_text,
            "eos_token": eos_text,
            "unk_token": token_of("unknown_token_id")[1],
            "pad_token": token_of("padding_token_id")[1],
        }
        special_tokens = {name: text for name, text in named.items() if text is not None}

        # Control tokens (type 3) become special added tokens, so text like "<|im_start|>" stays whole
        # and decode(skip_special_tokens=True) drops them. In a byte-level vocabulary a control token
        # spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it, so do we.
        alphabet = set(_bytes_to_unicode().values()) if model == "gpt2" else None
        vocab = backend.get_vocab()
        control = [
            token
            for token, token_type in zip(tokens, token_types, strict=False)
            if token_type == _TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet)
        ]
        # transformers also marks its tokenizer class's default specials and the file's named tokens as
        # special. It appends those missing from the vocabulary as new ids past the model's
        # embedding; we only mark the ones the vocabulary has.
        control += [t for t in (*named_defaults, *special_tokens.values()) if t in vocab]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(control)])
        # User-defined tokens (type 4, e.g. "<think>") are matched whole in the text but are not special.
        user_defined = [
            AddedToken(token, normalized=False, special=False)
            for token, token_type in zip(tokens, token_types, strict=False)
            if token_type == _TOKEN_TYPE_USER_DEFINED and token in vocab
        ]
        if user_defined:
            backend.add_tokens(user_defined)

        add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos_default)
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        extra_eos = [
            int(meta[key]) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if key in meta
        ]
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            extra_eos_ids=extra_eos,
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special_tokens,
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, shape [n]. Special-token text such as "<|im_start|>" maps to its id.

        With `add_special_tokens`, BOS is prepended when `add_bos` (and EOS appended when the
        checkpoint asks for it, which decoder checkpoints almost never do).
        """
        if not isinstance(text, str):
            raise LithosError(f"encode takes a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids = [self.bos_id, *ids]
            if self.add_eos:
                ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (any iterable of ints: list, numpy or jax array of shape [n])."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence (see `StreamDecoder`)."""
        return StreamDecoder(self._backend, self._special_ids, self._byte_ids, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as in the vocabulary (e.g. "<|im_end|>"), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        """The vocabulary spelling of an id (byte-level vocabularies spell a space as "Ġ")."""
        return self._backend.id_to_token(int(index))

    # ------------------------------------------------------------------ chat

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_vars: Any,
    ) -> str:
        """The conversation rendered by the checkpoint's chat template, as transformers'
        `apply_chat_template(messages, tokenize=False, ...)` renders it.

        `messages` are dicts with 'role' (one of ALLOWED_ROLES) and 'content'. `tools` (JSON schemas)
        and `template_vars` (e.g. enable_thinking=False) are passed to the template.
        """
        if not self.chat_template:
            raise LithosError(
                "this checkpoint has no chat template, so a conversation cannot be formatted: "
                "pass the prompt as raw text instead (--raw)"
            )
        chat = _check_messages(messages)
        template = _compile_chat_template(self.chat_template)
        variables = {**self._special_tokens, **_plain(template_vars)}
        try:
            return template.render(
                messages=chat,
                tools=_plain(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as err:
            raise LithosError(f"the chat template rejected the conversation: {err.message}") from err
        except jinja2.exceptions.TemplateError as err:
            raise LithosError(
                f"the chat template failed on this conversation ({type(err).__name__}: {err}); "
                "check the messages or pass raw prompts (--raw)"
            ) from err

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any) -> list[int]:
        """Token ids of the rendered conversation, shape [n]. No BOS is added: the template writes
        whatever special tokens it wants, as in transformers' tokenized `apply_chat_template`."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **template_vars)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"stop_ids={self.stop_ids}, add_bos={self.add_bos}, "
            f"chat_template={self.chat_template is not None})"
        )


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str]) -> BackendTokenizer:
    """GPT-2 style byte-level BPE from GGUF metadata (transformers' `byte_level_tokenizer`)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp stores some tokens as plain UTF-8; the BPE model wants every token in the byte alphabet.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = _gguf_merges(meta, tokens)
    try:
        backend = BackendTokenizer(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
    except Exception as err:
        raise CheckpointError(f"the GGUF's byte-level BPE vocabulary is inconsistent: {err}") from err
    split = _GGUF_PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str]) -> BackendTokenizer:
    """Sentencepiece-style BPE with byte fallback from GGUF metadata (transformers' LlamaTokenizer build).

    Spaces become "▁" and one is prepended to the first word (Metaspace, prepend "first"); unknown
    characters become <0xXX> byte tokens.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _gguf_merges(meta, tokens)
    try:
        backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    except Exception as err:
        raise CheckpointError(f"the GGUF's sentencepiece vocabulary is inconsistent: {err}") from err
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return backend
