"""Build megakernel variants and the fused kernels for this machine's GPU, all at once (the GPU tests and
`lithos bench` would build missing variants one by one, on first use, inside their time limits).

    python3 benchmarks/build_variants.py [--tokens 1,8] gate_up gate_up,down q4_k:q6_k:bfloat16

Each argument is a megakernel build: a LITHOS_TILES set of an MXFP4 build (attention and MLP in MXFP4, bf16 head), or
the formats of Q/K/V, gate/up and the head, and of O and down where theirs differ, separated by colons
(k_mix:q4_k:bfloat16:q4_k:k_mix is how the megakernel reads a Q4_K_M file). The bf16 build, the bf16 fused kernels
and the packed fused kernels of every format the variants read are built too. LITHOS_KERNEL_DEFINES and
LITHOS_CACHE_DIR apply as to any build. The megakernel is a library a token bucket; `--tokens` builds only the
buckets of those counts (a run that times one-token steps alone needs one), else all five.
"""

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from lithos.custom_calls import build
from lithos.custom_calls.launch import TOKEN_BUCKETS, token_bucket
from lithos.custom_calls.megakernel.kernel import TILE_GROUPS, WeightFormats

# The fused kernels every run uses (the bf16 ones); the packed ones are built for the formats the variants read.
FUSED = ("matvec", "qkv_rope", "lm_head", "attention")


def megakernel_formats(arg: str) -> WeightFormats:
    if ":" in arg:
        attention, mlp, head, *own = arg.split(":")
        o, down = (own + [None, None])[:2]
        return WeightFormats(attention, mlp, head, o=o if o != attention else None, down=down if down != mlp else None)
    groups = set(arg.split(","))
    if not groups <= TILE_GROUPS.keys():
        raise SystemExit(f"{arg!r}: name tile groups from {', '.join(TILE_GROUPS)}, or formats as attention:mlp:head")
    tiles = {f"{group}_tiles": group in groups for group in TILE_GROUPS}
    return WeightFormats("mxfp4", "mxfp4", "bfloat16", **tiles)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_BUCKETS)), help="token counts, e.g. 1,8")
    parser.add_argument("builds", nargs="*", help="tile groups (gate_up,down) or formats (attention:mlp:head)")
    args = parser.parse_args(argv)
    toolchain = build.toolchain("cuda")
    formats = [megakernel_formats(a) for a in args.builds]
    # Each build's library a token bucket (build.BUCKETED_KERNELS), as the steps load them; the largest buckets, the
    # longest compiles, first.
    buckets = sorted({token_bucket(int(n)) for n in args.tokens.split(",")}, reverse=True)
    builds = dict.fromkeys([WeightFormats(), *formats])
    jobs = [("megakernel", f.variant(tokens)) for tokens in buckets for f in builds]
    packed = sorted({name for f in formats for name in f.every_format} - {"bfloat16"})
    jobs += [(kernel, build.PLAIN) for kernel in (*FUSED, *(f"matvec_packed_{name}" for name in packed))]

    def one(job) -> str:
        kernel, variant = job
        try:
            return f"{kernel} {variant.suffix or 'plain'}: {build.build(kernel, variant.toolchain(toolchain)).name}"
        except Exception as e:  # reported, and the rest go on: the tests name what is missing
            return f"{kernel} {variant.suffix or 'plain'}: FAILED {e}"

    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        lines = list(pool.map(one, jobs))
    print("\n".join(lines))
    return int(any("FAILED" in line for line in lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
