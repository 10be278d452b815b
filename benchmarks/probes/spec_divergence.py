"""Where a kernel path's speculative tokens leave the reference path's, and how near a tie the
reference's logits are there (run 45).

The spec bench's round timing (`lithos bench --spec ngram --shape ...`) runs every path from the same
random-token prompt on the same random weights; its tokens per round differ between paths when their
greedy tokens do. This replays those rounds per path, finds the first position where a path's tokens
differ from the reference's, and prints the reference's logits there from a prefill over the common
prefix: a gap of a few thousandths between the two best is a near-tie met in another summation order.

    PYTHONPATH=. python3 benchmarks/probes/spec_divergence.py --shape llama-3.1-8b --kernels fused,megakernel
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from lithos import bench
from lithos.models import family_for_architecture, init_model_cache
from lithos.spec.bench import prefilled_rounds_state
from lithos.spec.engine import Speculator
from lithos.spec.loop import spec_rounds
from lithos.spec.ngram import NGramDrafter


def speculative_tokens(params, cfg, kernels: str, context: int, k: int, rounds: int) -> tuple[np.ndarray, list[int]]:
    """Prompt and generated tokens after `rounds` greedy n-gram rounds from the spec bench's prompt, and
    the rounds' histogram."""
    speculator = Speculator(NGramDrafter(), None, k)
    start = prefilled_rounds_state(params, cfg, speculator, context, rounds)
    state = spec_rounds(params, None, start, cfg, speculator.drafter, k, rounds, True, kernels)
    return np.asarray(state.history[0, : int(state.decode.position[0])]), state.stats.histogram[0].tolist()


def reference_logits(params, cfg, fam, tokens: np.ndarray) -> np.ndarray:
    """The reference path's next-token logits after `tokens` (one prefill)."""
    n = len(tokens)
    cache = init_model_cache(cfg, 1, n + 8, params.embed.dtype)
    logits, _ = jax.jit(lambda p, t, c: fam.forward(p, t, jnp.arange(n)[None], c, cfg))(
        params, jnp.asarray(tokens[None], jnp.int32), cache
    )
    return np.asarray(logits[0, -1], np.float64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--kernels", default="fused,megakernel", help="paths to compare with the reference")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--draft-tokens", type=int, default=7)
    p.add_argument("--rounds", type=int, default=32)
    args = p.parse_args()
    cfg, params = bench.shape_model(args.shape, jnp.bfloat16)  # the spec bench's weights
    fam = family_for_architecture(cfg.architecture)

    def run(kernels: str):
        return speculative_tokens(params, cfg, kernels, args.context, args.draft_tokens, args.rounds)

    ref, histogram = run("reference")
    print(f"reference  positions {len(ref)} histogram {histogram}")
    for kernels in args.kernels.split(","):
        tokens, histogram = run(kernels)
        n = min(len(tokens), len(ref))
        differ = np.nonzero(tokens[:n] != ref[:n])[0]
        first = int(differ[0]) if len(differ) else None
        print(f"{kernels:10s} positions {len(tokens)} histogram {histogram} first difference at {first}")
        if first is not None:
            row = reference_logits(params, cfg, fam, ref[:first])
            best = np.argsort(row)[::-1][:3]
            gap = row[ref[first]] - row[tokens[first]]
            print(
                f"   reference prefill logits there: best {best.tolist()} {row[best].round(4).tolist()}, row std "
                f"{row.std():.4f}; reference decode chose {ref[first]}, {kernels} chose {tokens[first]}; "
                f"gap {gap:.4f}"
            )


if __name__ == "__main__":
    main()
