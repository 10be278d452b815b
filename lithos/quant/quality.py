"""How much quantizing changed a model: KL divergence of next-token distributions and perplexity on a
text sample, quantized against unquantized, with the same tokens through the same forward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos.kv_cache import init_cache
from lithos.models import family_of

# A sample written for lithos (no license strings attached): plain expository English of the kind
# small instruction models see, long enough for a few hundred tokens of perplexity.
SAMPLE_TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only visitors were gulls. \
Its keeper, an old man who had once been a ship's engineer, kept a logbook in which he wrote the weather every \
morning: the direction of the wind, the height of the swell, the colour of the sky at dawn. He said that the sea \
was never the same twice, but that if you watched it long enough you could learn what it was about to do.

In the spring the supply boat came every two weeks. It brought flour, lamp oil, letters and newspapers that were \
already old by the time they arrived. The keeper read them anyway, slowly, from the first page to the last, \
because news that is late is still news to someone who has not heard it.

A computer works in a similar way, though it is much faster. A program is a list of instructions, and the \
processor reads them one at a time, fetching data from memory, doing a small piece of arithmetic, and writing \
the result back. Memory is slow compared with arithmetic, so modern chips keep copies of recently used data in \
small, fast caches. When a program reads the same numbers again and again, the caches make it fast; when it \
reads a large table only once, the speed of memory decides how long it takes.

Language models are an example of the second kind. To produce a single word, a model must read every one of its \
weights once, and there may be billions of them. Storing each weight in fewer bits means fewer bytes to read, and \
so more words per second, as long as the rounding does not change what the model says. Measuring that change \
carefully is the only way to know whether a smaller model is still the same model.

Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on a mountain, because the air \
pressure is lower. Bread rises because yeast produces carbon dioxide, and the gluten in the dough traps the gas \
in small bubbles. A bicycle stays upright mostly because of the way its front wheel steers into a fall.
"""


def next_token_logprobs(params: Any, cfg: Any, tokens: list[int]) -> jax.Array:
    """Log-probabilities `[tokens, vocab]` (f32) of every next token, from one forward over `tokens`."""
    family = family_of(cfg)
    n = len(tokens)
    dtype = params.embed.dtype
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim, dtype)
    forward = jax.jit(partial(family.forward, cfg=cfg))
    logits, _ = forward(params, jnp.asarray([tokens], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None], cache)
    return jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)


def compare_logprobs(reference: jax.Array, quantized: jax.Array, tokens: list[int]) -> dict[str, float]:
    """KL(reference || quantized) per position and both perplexities on `tokens`.

    reference, quantized: `[tokens, vocab]` log-probabilities of the token after each position.
    """
    kl = jnp.sum(jnp.exp(reference) * (reference - quantized), axis=-1)[:-1]  # the last has no target
    targets = jnp.asarray(tokens[1:])[:, None]
    nll_ref = -jnp.take_along_axis(reference[:-1], targets, axis=-1).mean()
    nll_q = -jnp.take_along_axis(quantized[:-1], targets, axis=-1).mean()
    agree = jnp.mean(jnp.argmax(reference[:-1], -1) == jnp.argmax(quantized[:-1], -1))
    kl = np.asarray(kl, np.float64)
    return {
        "positions": int(kl.size),
        "kl_mean": float(kl.mean()),
        "kl_median": float(np.median(kl)),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "perplexity_reference": float(np.exp(float(nll_ref))),
        "perplexity_quantized": float(np.exp(float(nll_q))),
        "top1_agreement": float(agree),
    }


def quality_report(
    reference_params: Any, quantized_params: Any, cfg: Any, tokens: list[int]
) -> dict[str, float]:
    """`compare_logprobs` of two parameter sets of one model on the same tokens."""
    reference = next_token_logprobs(reference_params, cfg, tokens)
    quantized = next_token_logprobs(quantized_params, cfg, tokens)
    return compare_logprobs(reference, quantized, tokens)
