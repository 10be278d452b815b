"""Compile the kernel sources under `csrc/`, cache the libraries per user, register them with XLA.

A library is built on first use and kept under `~/.cache/lithos/kernels` (or `$LITHOS_CACHE_DIR`),
named by a key over everything that changes its machine code: the kernel source and every header
beside it, the target architecture, the compiler's version and jaxlib's version (the FFI headers it
is compiled against). Build them all ahead of time, e.g. for a container image:

    python -m lithos.custom_calls.build --platform cuda --arch sm_90a
    python -m lithos.custom_calls.build --platform rocm --arch gfx942

Variants for experiments: `LITHOS_KERNEL_DEFINES="NAME=VALUE ..."` passes `-DNAME=VALUE` to the compile
of each kernel whose sources name NAME (the knobs a source declares with #ifndef, e.g. csrc/megakernel.cu's
LITHOS_MK_MIN_BLOCKS); those defines are part of the key, so each variant is cached beside the default build, and
a kernel that does not read them keeps its default build.

A GPU with no compiler is an error that says what to install: the kernels never fall back to the
reference path unless the caller asks for it (`path="reference"`).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

from lithos.custom_calls.launch import TOKEN_BUCKETS, token_bucket
from lithos.errors import LithosError

CSRC = Path(__file__).parent / "csrc"

# The packed weight formats with a source of their own (csrc/matvec_packed_<format>.cu); packed_weights.py's
# FORMAT_CODES names the same (tests/test_custom_calls_packed.py).
PACKED_SOURCES = (
    *("mxfp4", "mxfp8", "fp8_block128"),
    *("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs"),
    *("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "k_mix"),
)

# Kernel source (csrc/<name>.cu) -> the FFI handler symbols it defines, each registered under its
# own name as an XLA custom-call target.
PACKED_HANDLERS = (
    *("LithosPackedMatvec", "LithosPackedGateUpSilu"),
    *("LithosPackedQkvRopeAppend", "LithosPackedQkvProject"),
)
KERNELS: dict[str, tuple[str, ...]] = {
    "matvec": ("LithosMatvec", "LithosGateUpSilu"),
    "attention": ("LithosDecodeAttention", "LithosDecodeAttentionFp8"),
    "qkv_rope": ("LithosQkvRopeAppend", "LithosQkvRopeAppendFp8", "LithosQkvProject"),
    "qk_norm_rope": ("LithosQkNormRopeAppend", "LithosQkNormRopeAppendFp8"),
    "lm_head": ("LithosLmHeadArgmax",),
    "megakernel": ("LithosMegakernel",),
    # One source per packed weight format (csrc/matvec_packed.h), built in parallel and only when used.
    **{
        f"matvec_packed_{fmt}": tuple(f"{op}_{fmt}" for op in PACKED_HANDLERS)
        for fmt in PACKED_SOURCES
    },
    "expert_matvec": ("LithosExpertMatvec", "LithosExpertGateUpSilu"),
}
# The packed formats' sources: each one format's instance of matvec_packed.h.
PACKED_KERNELS = tuple(f"matvec_packed_{fmt}" for fmt in PACKED_SOURCES)

PLATFORMS = ("cuda", "rocm")
# jax's platform names for register_ffi_target.
XLA_PLATFORM = {"cuda": "CUDA", "rocm": "ROCM"}
DEFAULT_ARCH = {"cuda": "sm_90a", "rocm": "gfx942"}
# The oldest NVIDIA GPU a kernel builds for (compute capability x 10), and what to use below it. The
# megakernel's 16-token kernel declares 51,712 bytes of static shared memory, above the 48 KiB that sm_80
# to sm_89 allow; the fused kernels build for those GPUs (test_fused_kernels_compile_for_ampere).
MIN_CUDA_ARCH = {"megakernel": (90, "use kernels='fused', whose kernels build for it")}

# The XLA FFI headers warn about missing returns inside them; those warnings are not ours.
_NVCC_FLAGS = (
    "-std=c++17",
    "-shared",
    "-Xcompiler",
    "-fPIC",
    "-Xcompiler",
    "-Wno-return-type",
    "-diag-suppress",
    "940,2473",
)
_HIPCC_FLAGS = ("-std=c++17", "-shared", "-fPIC", "-Wno-return-type")

INSTALL_HINT = {
    "cuda": (
        "install the CUDA toolkit's compiler matching your driver (NVIDIA's apt package "
        "`cuda-nvcc-13-0` with `cuda-cudart-dev-13-0`, or the full `cuda-toolkit-13-0`) and put `nvcc` on "
        "PATH, set CUDA_HOME, or point LITHOS_NVCC at it"
    ),
    "rocm": (
        "install ROCm's HIP compiler (`apt-get install rocm-hip-sdk` from AMD's ROCm repository, or Debian's "
        "`apt-get install hipcc`) and put `hipcc` on PATH, set ROCM_PATH, or point LITHOS_HIPCC at it"
    ),
}


CHECK_OPT_LEVEL = 0  # a compile check's build (CI): see Toolchain.opt_level


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """How to compile for one GPU target: `platform` "cuda" or "rocm", arch e.g. "sm_90a" or "gfx942"."""

    platform: str
    compiler: str
    version: str
    arch: str
    # 3 for kernels that run. A compile check (CI, where no GPU runs them) asks for CHECK_OPT_LEVEL:
    # every phase still runs (front end, device code generation, assembler, link) without optimising
    # (nvcc's device compiler and assembler too: the megakernel in 12 s instead of 42), and only two of
    # the five token buckets are instantiated (ffi_util.h LITHOS_TWO_BUCKETS): every template and code
    # path still compiles. nvcc's device compiler runs at -O1 there: its unoptimised PTX costs the
    # assembler more than -O1 costs it (a Q4_K_M megakernel 14.0 s -> 9.5 s; the fused kernels the same).
    opt_level: int = 3
    defines: tuple[str, ...] = ()  # NAME=VALUE, from $LITHOS_KERNEL_DEFINES
    # Source lines in the library's line tables, for a disassembly that says where each instruction came from
    # (sass_compare --lines); the code is the same either way.
    line_info: bool = False

    def command(self, source: Path, output: Path) -> list[str]:
        check = ["LITHOS_TWO_BUCKETS=1"] if self.opt_level != 3 else []
        include = [f"-I{jax.ffi.include_dir()}", f"-I{CSRC}", *(f"-D{d}" for d in (*check, *self.defines))]
        optimize = [f"-O{self.opt_level}"]
        if self.line_info:
            optimize.append("-lineinfo" if self.platform == "cuda" else "-gline-tables-only")
        if self.platform == "cuda":
            # -gencode, not -arch=sm_90a: the shorthand also runs a plain sm_90 pass (HOPPER.md).
            arch = self.arch.removeprefix("sm_")
            target = [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
            if self.opt_level != 3:  # nvcc's -O is the host's; device compiler and assembler have their own
                optimize += ["-Xcicc", f"-O{max(self.opt_level, 1)}", "-Xptxas", f"-O{self.opt_level}"]
            return [self.compiler, *optimize, *_NVCC_FLAGS, *target, *include, "-o", str(output), str(source)]
        return [
            self.compiler,
            *optimize,
            *_HIPCC_FLAGS,
            f"--offload-arch={self.arch}",
            *include,
            "-x",
            "hip",
            str(source),
            "-o",
            str(output),
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.platform == "rocm":
            env.setdefault("HIP_PLATFORM", "amd")  # Debian's hipcc otherwise hands the source to nvcc
        return env


def cache_dir() -> Path:
    if "LITHOS_CACHE_DIR" in os.environ:
        return Path(os.environ["LITHOS_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "lithos" / "kernels"


def find_compiler(platform: str) -> str | None:
    """Path of nvcc (cuda) or hipcc (rocm): $LITHOS_NVCC/$LITHOS_HIPCC, PATH, then the toolkit's home."""
    name, override, homes = {
        "cuda": ("nvcc", "LITHOS_NVCC", ("CUDA_HOME", "CUDA_PATH")),
        "rocm": ("hipcc", "LITHOS_HIPCC", ("ROCM_PATH", "HIP_PATH")),
    }[platform]
    if os.environ.get(override):
        return os.environ[override]
    found = shutil.which(name)
    if found:
        return found
    defaults = {"cuda": "/usr/local/cuda", "rocm": "/opt/rocm"}[platform]
    for home in [os.environ.get(h) for h in homes] + [defaults]:
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    return None


@functools.cache
def compiler_version(compiler: str) -> str:
    env = {"HIP_PLATFORM": "amd", **os.environ}
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, env=env)
    return result.stdout.strip() or result.stderr.strip()


def jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return jax.__version__


def gpu_platform() -> str | None:
    """ "cuda" or "rocm" when jax has that backend, else None."""
    for platform in PLATFORMS:
        try:
            if jax.devices(platform):
                return platform
        except RuntimeError:
            continue
    return None


def detect_arch(platform: str) -> str:
    """The target of the first GPU jax sees ($LITHOS_GPU_ARCH overrides): sm_90a on an H100/H200."""
    if os.environ.get("LITHOS_GPU_ARCH"):
        return os.environ["LITHOS_GPU_ARCH"]
    try:
        capability = str(getattr(jax.devices(platform)[0], "compute_capability", ""))
    except RuntimeError:
        capability = ""
    if platform == "cuda" and capability:
        major, minor = capability.split(".")[:2]
        # Hopper and Blackwell kernels may use arch-specific instructions: build the "a" variant.
        return f"sm_{major}{minor}{'a' if int(major) >= 9 else ''}"
    if platform == "rocm" and capability.startswith("gfx"):
        return capability.split(":")[0]
    return DEFAULT_ARCH[platform]


def toolchain(platform: str, arch: str | None = None) -> Toolchain:
    compiler = find_compiler(platform)
    if compiler is None:
        raise LithosError(
            f"no {'nvcc' if platform == 'cuda' else 'hipcc'} was found, and lithos compiles its fused "
            f"kernels for {platform.upper()} GPUs on first use: {INSTALL_HINT[platform]}. Or build them "
            "elsewhere with `python -m lithos.custom_calls.build` into the same LITHOS_CACHE_DIR, or run "
            "the reference path explicitly (kernels='reference')."
        )
    defines = tuple(os.environ.get("LITHOS_KERNEL_DEFINES", "").split())
    return Toolchain(platform, compiler, compiler_version(compiler), arch or detect_arch(platform), defines=defines)


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"/]+)"', re.MULTILINE)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def kernel_sources(kernel: str) -> dict[Path, str]:
    """The text of csrc/<kernel>.cu and of each csrc header it includes, directly or through another."""
    todo, sources = [CSRC / f"{kernel}.cu"], {}
    while todo:
        path = todo.pop()
        if path not in sources and path.exists():
            sources[path] = path.read_text()
            todo += [CSRC / name for name in _INCLUDE.findall(sources[path])]
    return sources


def kernel_toolchain(kernel: str, tc: Toolchain) -> Toolchain:
    """`tc` keeping only the defines whose names `kernel`'s sources contain: a macro that no line of a
    translation unit names cannot change its code, so a define for one kernel (a megakernel experiment)
    leaves every other kernel's key, and its cached library, as they are."""
    if not tc.defines:
        return tc
    names = set(_IDENTIFIER.findall("\n".join(kernel_sources(kernel).values())))
    kept = tuple(define for define in tc.defines if define.split("=", 1)[0] in names)
    return tc if kept == tc.defines else dataclasses.replace(tc, defines=kept)


def source_key(kernel: str, tc: Toolchain) -> str:
    tc = kernel_toolchain(kernel, tc)
    digest = hashlib.sha256()
    for path in [CSRC / f"{kernel}.cu", *sorted(CSRC.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (tc.platform, tc.arch, tc.version, jaxlib_version(), " ".join(tc.command(Path(), Path()))):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:20]


def library_path(kernel: str, tc: Toolchain) -> Path:
    return cache_dir() / f"{kernel}-{tc.platform}-{tc.arch}-{source_key(kernel, tc)}.so"


def check_arch(kernel: str, tc: Toolchain) -> None:
    """Raises, naming the way out, when `kernel` does not build for `tc`'s GPU (MIN_CUDA_ARCH)."""
    if tc.platform != "cuda" or kernel not in MIN_CUDA_ARCH:
        return
    oldest, fix = MIN_CUDA_ARCH[kernel]
    digits = tc.arch.removeprefix("sm_").rstrip("abf")  # sm_90a, sm_100a, sm_120f
    if digits.isdigit() and int(digits) < oldest:
        raise LithosError(
            f"{kernel}.cu needs an NVIDIA GPU of compute capability {oldest // 10}.{oldest % 10} or newer "
            f"(Hopper, Blackwell), and this one is {tc.arch}: {fix}"
        )


def check_kernel(kernel: str, tc: Toolchain) -> None:
    """Raises, naming the way out, for a kernel lithos does not have or that does not build for `tc`'s GPU."""
    if kernel not in KERNELS:
        raise LithosError(f"unknown kernel {kernel!r}; the kernels are {', '.join(KERNELS)}")
    check_arch(kernel, tc)


def build(kernel: str, tc: Toolchain, force: bool = False) -> Path:
    """Compile csrc/<kernel>.cu for `tc` unless the cache already holds it; returns the library."""
    check_kernel(kernel, tc)
    tc = kernel_toolchain(kernel, tc)
    output = library_path(kernel, tc)
    if output.exists() and not force:
        return output
    compile_library(f"{kernel}.cu", CSRC / f"{kernel}.cu", output, tc)
    return output


def build_together(kernels: tuple[str, ...], tc: Toolchain, force: bool = False) -> Path:
    """A compile check (CI's): the sources of `kernels` as one translation unit, a generated source that includes
    each, so that their shared headers (the FFI's among them, some 5 s of nvcc a source) are compiled once. Returns
    that library, which exports every source's handlers; what a GPU loads is each source's own (`build`)."""
    for kernel in kernels:
        check_kernel(kernel, tc)
    output = together_path(kernels, tc)
    if output.exists() and not force:
        return output
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "together.cu"
        source.write_text("".join(f'#include "{kernel}.cu"\n' for kernel in kernels))
        compile_library(f"{', '.join(kernels)} together", source, output, tc)
    return output


def together_path(kernels: tuple[str, ...], tc: Toolchain) -> Path:
    """Where build_together keeps the library of `kernels` (keyed by each one's source and the toolchain)."""
    digest = hashlib.sha256("\0".join(f"{k}:{source_key(k, tc)}" for k in kernels).encode()).hexdigest()[:20]
    return cache_dir() / f"together-{tc.platform}-{tc.arch}-{digest}.so"


def compile_library(what: str, source: Path, output: Path, tc: Toolchain) -> None:
    """Compile `source` for `tc` to `output`, beside it and renamed, so that concurrent builders never see a
    half-written library; a compiler error raises with its message (`what` names the source in it). The compiler's
    temporaries go in the same scratch folder (TMPDIR): hipcc 5.2 leaves two empty folders in /tmp a compile."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        partial = Path(tmp) / output.name
        command = tc.command(source, partial)
        result = subprocess.run(command, capture_output=True, text=True, env={**tc.environment(), "TMPDIR": tmp})
        if result.returncode != 0:
            raise LithosError(
                f"compiling {what} for {tc.arch} with {tc.compiler} failed:\n{result.stderr[-4000:]}\n"
                f"command: {' '.join(command)}"
            )
        os.replace(partial, output)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A build of a source with compile-time choices the caller makes (e.g. the megakernel's weight
    formats): `defines` (NAME=VALUE) are added to the toolchain's, and the handlers are registered as
    `<symbol>_<suffix>`, so that several variants live in one process. The default is the plain build."""

    defines: tuple[str, ...] = ()
    suffix: str = ""

    def target(self, symbol: str) -> str:
        return f"{symbol}_{self.suffix}" if self.suffix else symbol

    def toolchain(self, tc: Toolchain) -> Toolchain:
        return dataclasses.replace(tc, defines=tc.defines + self.defines) if self.defines else tc


PLAIN = Variant()  # the build without the caller's choices

# Kernels that run from a library a token bucket (csrc/ffi_util.h LITHOS_ONE_BUCKET), so that a program compiles only
# the buckets it runs and a build of all five is five compiles side by side: the megakernel, whose MXFP4 build took
# 96 s of nvcc 13 with its five buckets together and 12 s for the one-token kernel alone (NOTES.md, "A library a
# token bucket"). A compile check (CHECK_OPT_LEVEL) still builds each source as one library.
BUCKETED_KERNELS = frozenset({"megakernel"})


def bucket_variant(variant: Variant, tokens: int) -> Variant:
    """`variant` holding only the kernels for `tokens` query positions (their bucket's), as a step of a
    BUCKETED_KERNELS source calls it."""
    bucket = token_bucket(tokens)
    return Variant((*variant.defines, f"LITHOS_ONE_BUCKET={bucket}"), f"{variant.suffix}_t{bucket}".lstrip("_"))


def bucket_toolchains(kernel: str, tc: Toolchain) -> list[Toolchain]:
    """The toolchains of the libraries a GPU loads for `kernel`: one a token bucket for BUCKETED_KERNELS, else `tc`
    (and `tc` for a compile check, which builds each source as one library)."""
    if kernel not in BUCKETED_KERNELS or tc.opt_level != 3:
        return [tc]
    return [bucket_variant(PLAIN, bucket).toolchain(tc) for bucket in TOKEN_BUCKETS]


# Build variants kept beside the default for experiments and A/B runs (LITHOS_KERNEL_DEFINES), each with
# the kernels that read its define. `--variants` builds them all, as CI's compile gate does
# (tests/test_custom_calls.py), so none rots between the device runs that compare it (NOTES.md). A variant of
# a code path only some weight formats compile names their defines after its own ("NAME=VALUE ...").
# The MXFP4 megakernel build with every group in fragment tiles (bf16 head): where the tiled variants' code runs.
_MXFP4_ALL_TILES = (
    "LITHOS_MK_ATTENTION_FORMAT=1 LITHOS_MK_MLP_FORMAT=1 LITHOS_MK_HEAD_FORMAT=0 LITHOS_MK_QKV_TILES=1 "
    "LITHOS_MK_O_TILES=1 LITHOS_MK_GATE_UP_TILES=1 LITHOS_MK_DOWN_TILES=1"
)
EXPERIMENT_VARIANTS: dict[str, tuple[str, ...]] = {
    # Weights through registers: the path HIP builds and the larger token buckets take, and the knob the
    # megakernel's grid error names.
    "LITHOS_MK_LANE_RING=0": ("megakernel",),
    # One accumulator per token group in the tensor-core matvecs (the default is 4).
    "LITHOS_MMA_ACCUMULATORS=1": ("megakernel", "matvec"),
    # Every fused row-group kernel on the 16-row tensor-core layout (the default puts gate/up and the LM
    # head there): measured slower on the O, down and Q/K/V projections.
    "LITHOS_FUSED_WIDE_MMA=2": ("matvec", "qkv_rope", "lm_head"),
    # The split attention on tensor cores at head dimension 128 too (the default stops at 64): slower there
    # (run 60), and 255 registers.
    "LITHOS_ATTENTION_MMA=128": ("attention",),
    # Two 256-input chunks in flight on the fused 4-row tensor-core path (the default is one, two blocks per SM).
    "LITHOS_FUSED_MMA_CHUNKS=2": ("matvec", "qkv_rope"),
    # The routed-expert kernels at two blocks an SM, with fewer loads in flight a warp (NOTES.md, "The expert
    # kernels' occupancy"; run 126).
    "LITHOS_EXPERT_TWO_BLOCKS=1": ("expert_matvec",),
    # The megakernel's 4-16-token attention splits on tensor cores (NOTES.md, "The 4-16-token attention on tensor
    # cores in the megakernel").
    "LITHOS_MK_ATTN_MMA=1": ("megakernel",),
    # The tiled single-matrix tasks' chunks in registers, a step in flight, rather than through the lane ring's
    # stages (NOTES.md, "Run 143 measured"), in the MXFP4 build with every group tiled, where they run.
    f"LITHOS_MK_TILE_RING=0 {_MXFP4_ALL_TILES}": ("megakernel",),
    # The one-token Q/K/V tiles through the ring as well, rather than registers (NOTES.md, "Run 143 measured").
    f"LITHOS_MK_QKV_RING=1 {_MXFP4_ALL_TILES}": ("megakernel",),
    # The one-token O projection's chunks asked for after its wait (NOTES.md, "The one-token O projection's chunks
    # after its wait").
    f"LITHOS_MK_O_LATE_FILL=1 {_MXFP4_ALL_TILES}": ("megakernel",),
}

_registered: set[tuple[str, str, Variant]] = set()
_register_lock = threading.Lock()


def ensure_registered(kernel: str, platform: str, variant: Variant = PLAIN) -> None:
    """Build (if needed), load and register every handler of `kernel` (as `variant`) for `platform`, once
    per process."""
    with _register_lock:
        if (kernel, platform, variant) in _registered:
            return
        library = ctypes.cdll.LoadLibrary(str(build(kernel, variant.toolchain(toolchain(platform)))))
        for symbol in KERNELS[kernel]:
            jax.ffi.register_ffi_target(
                variant.target(symbol), jax.ffi.pycapsule(getattr(library, symbol)), platform=XLA_PLATFORM[platform]
            )
        _registered.add((kernel, platform, variant))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build lithos' fused kernels ahead of time.")
    parser.add_argument(
        "--platform", choices=PLATFORMS, default=None, help="default: the GPU backend jax sees, else cuda"
    )
    parser.add_argument("--arch", default=None, help="e.g. sm_90a, gfx942 (default: the visible GPU's)")
    parser.add_argument(
        "--kernel",
        action="append",
        choices=sorted(KERNELS),
        help="build only these (repeatable; default: all)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument(
        "--variants", action="store_true", help="build the experiment variants (EXPERIMENT_VARIANTS) instead"
    )
    parser.add_argument(
        "--opt-level",
        type=int,
        choices=(CHECK_OPT_LEVEL, 3),
        default=3,
        help=f"3: the libraries the GPU loads; {CHECK_OPT_LEVEL}: a compile check (every compiler phase and code "
        "path, unoptimised, in a third of the time or less)",
    )
    parser.add_argument(
        "--packed-together",
        action="store_true",
        help="compile the packed formats' sources as one library (a compile check: what the GPU loads is each "
        "source's own)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="compilers run at once (default: one a library, all at once)",
    )
    args = parser.parse_args(argv)

    platform = args.platform or gpu_platform() or "cuda"
    try:
        tc = dataclasses.replace(toolchain(platform, args.arch), opt_level=args.opt_level)
        if args.variants:
            jobs = [
                (kernel, dataclasses.replace(tc, defines=tc.defines + tuple(define.split())))
                for define, kernels in EXPERIMENT_VARIANTS.items()
                for kernel in kernels
            ]
        else:
            jobs = [(kernel, tc) for kernel in args.kernel or list(KERNELS)]
        jobs = [(kernel, each) for kernel, job_tc in jobs for each in bucket_toolchains(kernel, job_tc)]
        together = tuple(k for k, _ in jobs if k in PACKED_KERNELS) if args.packed_together else ()
        jobs = [job for job in jobs if job[0] not in together]
        with ThreadPoolExecutor(max_workers=args.jobs or len(jobs) + 1) as pool:
            joint = pool.submit(build_together, together, tc, args.force) if together else None
            paths = list(pool.map(lambda job: build(*job, args.force), jobs))
            if joint is not None:
                jobs.append((f"{len(together)} packed sources together", tc))
                paths.append(joint.result())
    except LithosError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for (kernel, job_tc), path in zip(jobs, paths, strict=True):
        print(f"{kernel:10s} {job_tc.arch:8s} {' '.join(job_tc.defines):28s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
