r"""What a kernel change compiles to: the SASS of one kernel source in two builds, function by function.

A side is a revision of the tree ("." is the working tree) and the defines it is built with; each side
is compiled the way lithos builds it for the device (csrc/<kernel>.cu, -O3, every token bucket, for
sm_90a unless --arch says; the working tree's build goes to, or comes from, lithos's kernel cache), dumped
with cuobjdump, and its functions compared whole, with addresses, encodings and the anonymous-namespace
hashes stripped (however long a function is: the megakernel's run to 21,000-69,000 instructions, so a
comparison by a fixed-width address pattern would stop early).

    python -m lithos.custom_calls.sass_compare megakernel                 # HEAD against the working tree
    python -m lithos.custom_calls.sass_compare matvec --a . --b-defines LITHOS_FUSED_MMA_CHUNKS=2
    python -m lithos.custom_calls.sass_compare attention --a HEAD~3 --b HEAD --diff

Prints, per function, each side's instruction count, registers a thread (past 128 an SM holds fewer than
16 warps of it: a change with fewer instructions can run slower) and its global, local and shared-memory
operations, and whether the two are identical; exits 1 when any function differs (or is on one side only), so a
refactor meant to change nothing can be checked by a script. With --lines, both sides are built with line tables
(the same code) and each function's local loads and stores, i.e. its register spills, are counted by the source
line they were compiled from (an inlined helper's own line), side by side:

    python -m lithos.custom_calls.sass_compare megakernel --match 'megakernelILi1E' --lines \
        --a-defines LITHOS_MK_MLP_FORMAT=1 --b-defines "LITHOS_MK_MLP_FORMAT=1 LITHOS_MK_ATTN_SECOND_AHEAD=1"

Needs nvcc, and cuobjdump with the nvdisasm it calls (not part of the nvcc package: `pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, test dependencies here, or $LITHOS_CUOBJDUMP).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from lithos.custom_calls import build
from lithos.errors import LithosError

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
# An instruction line: "/*1a2b0*/   LDG.E.128 R4, desc[UR6][R2.64] ;   /* 0x... */" (any address width).
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(.*?)\s*(?:/\*\s*0x[0-9a-f]+\s*\*/)?\s*$")
# nvcc names an anonymous namespace after the file and a hash of its path: not part of the code.
_ANONYMOUS = re.compile(r"\d+_GLOBAL__N__[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}")
MEMORY_OPS = {"global": ("LDG", "STG"), "local": ("LDL", "STL"), "shared": ("LDS", "STS")}
# `cuobjdump --dump-resource-usage`: " Function NAME:" then "  REG:127 STACK:0 SHARED:1188 LOCAL:0 ...".
_USAGE_FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
_REGISTERS = re.compile(r"\bREG:(\d+)")
# `nvdisasm -g`: "//------ .text.NAME ------" opens a function; "//## File "PATH", line N[ inlined at ...]" names
# the innermost source line of the instructions under it.
_SECTION = re.compile(r"^//-+ \.text\.(\S+) -+$")
_SOURCE_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')


def functions(sass: str) -> dict[str, list[str]]:
    """`cuobjdump -sass` output as {function name: its instructions}, addresses and encodings stripped,
    spaces collapsed, the anonymous-namespace hash taken out of the names."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in sass.splitlines():
        if match := _FUNCTION.match(line):
            current = out.setdefault(_ANONYMOUS.sub("(anonymous)", match.group(1)), [])
        elif current is not None and (match := _INSTRUCTION.match(line)):
            current.append(" ".join(match.group(1).split()))
    return out


def registers(usage: str) -> dict[str, int]:
    """`cuobjdump --dump-resource-usage` output as {function name: registers a thread}, names as `functions`
    gives them."""
    out: dict[str, int] = {}
    name = None
    for line in usage.splitlines():
        if match := _USAGE_FUNCTION.match(line):
            name = _ANONYMOUS.sub("(anonymous)", match.group(1))
        elif name is not None and (match := _REGISTERS.search(line)):
            out.setdefault(name, int(match.group(1)))
            name = None
    return out


def memory_ops(instructions: Sequence[str]) -> dict[str, int]:
    """How many loads and stores of each memory space the instructions hold (predicates allowed)."""
    opcodes = [i.split()[1] if i.startswith("@") and len(i.split()) > 1 else i.split()[0] for i in instructions if i]
    return {space: sum(op.split(".")[0] in names for op in opcodes) for space, names in MEMORY_OPS.items()}


def local_access_lines(disassembly: str) -> dict[str, Counter[str]]:
    """`nvdisasm -g` output as {function name: {"file:line": its local loads and stores}}, names as `functions`
    gives them, each access counted at the innermost source line it was compiled from."""
    out: dict[str, Counter[str]] = {}
    current: Counter[str] | None = None
    where = "(no line)"
    for line in disassembly.splitlines():
        if match := _SECTION.match(line):
            current, where = out.setdefault(_ANONYMOUS.sub("(anonymous)", match.group(1)), Counter()), "(no line)"
        elif match := _SOURCE_LINE.match(line):
            where = f"{Path(match.group(1)).name}:{match.group(2)}"
        elif current is not None and (match := _INSTRUCTION.match(line)) and memory_ops([match.group(1)])["local"]:
            current[where] += 1
    return out


def lines_report(a: dict[str, Counter[str]], b: dict[str, Counter[str]], names: Sequence[str], top: int) -> str:
    """Each function's local loads and stores by source line, a's and b's side by side, the `top` lines with the
    most on either side."""
    lines = []
    for name in names:
        a_lines, b_lines = a.get(name, Counter()), b.get(name, Counter())
        if not (a_lines or b_lines):
            continue
        lines += ["", f"local loads and stores by source line, {short(name)}:", f"{'a':>6s} {'b':>6s}  line"]
        every = sorted(set(a_lines) | set(b_lines), key=lambda w: (-max(a_lines[w], b_lines[w]), w))
        lines += [f"{a_lines[w]:6d} {b_lines[w]:6d}  {w}" for w in every[:top]]
        if len(every) > top:
            rest = every[top:]
            lines.append(f"{sum(a_lines[w] for w in rest):6d} {sum(b_lines[w] for w in rest):6d}  ({len(rest)} more)")
        lines.append(f"{sum(a_lines.values()):6d} {sum(b_lines.values()):6d}  in all")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    a: list[str] | None
    b: list[str] | None
    a_registers: int | None = None
    b_registers: int | None = None

    @property
    def identical(self) -> bool:
        return self.a is not None and self.a == self.b


def compare(
    a: dict[str, list[str]],
    b: dict[str, list[str]],
    a_registers: dict[str, int] | None = None,
    b_registers: dict[str, int] | None = None,
) -> list[Row]:
    a_registers, b_registers = a_registers or {}, b_registers or {}
    return [
        Row(name, a.get(name), b.get(name), a_registers.get(name), b_registers.get(name))
        for name in sorted(set(a) | set(b))
    ]


def find_cuobjdump() -> str:
    """$LITHOS_CUOBJDUMP, PATH, nvcc's directory, then the nvidia-cuda-cuobjdump wheel's binary."""
    candidates = [os.environ.get("LITHOS_CUOBJDUMP"), shutil.which("cuobjdump")]
    nvcc = build.find_compiler("cuda")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent / "cuobjdump"))
    site = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    candidates += [str(p) for p in sorted(site.glob("*/bin/cuobjdump"))]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise LithosError(
        "cuobjdump was not found: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` (they land under "
        "site-packages/nvidia/*/bin), put CUDA's bin directory on PATH, or set LITHOS_CUOBJDUMP"
    )


def source_tree(rev: str, scratch: Path) -> Path:
    """The csrc/ directory of `rev` ("." = the working tree), extracted under `scratch` when needed."""
    if rev == ".":
        return build.CSRC
    repo = build.CSRC.parents[2]
    inside = build.CSRC.relative_to(repo)  # lithos/custom_calls/csrc
    target = scratch / re.sub(r"[^\w.-]", "_", rev)
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, str(inside)], capture_output=True)
    if archive.returncode != 0:
        raise LithosError(f"git archive {rev} failed: {archive.stderr.decode().strip()}: name a commit of {repo}")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target / inside


@dataclasses.dataclass(frozen=True)
class Side:
    """One side's build: its SASS, its resource usage, and (built with line tables) its disassembly with source
    lines."""

    sass: str
    usage: str
    disassembly: str | None = None


def side_sass(
    kernel: str,
    rev: str,
    defines: Sequence[str],
    arch: str,
    scratch: Path,
    cuobjdump: str,
    opt_level: int = 3,
    line_info: bool = False,
) -> Side:
    """Compile `kernel` from `rev` with `defines` as lithos builds it (at `opt_level`: 3 is what the GPU
    loads, build.CHECK_OPT_LEVEL the compile check), and dump its SASS and its resource usage; with `line_info`,
    also its disassembly with source lines."""
    tc = dataclasses.replace(
        build.toolchain("cuda", arch), defines=tuple(defines), opt_level=opt_level, line_info=line_info
    )
    if rev == ".":  # the working tree's library is the one lithos caches: a build made before is not made again
        library = build.build(kernel, tc)
    else:
        library = _compile(kernel, rev, tc, scratch)
    disassembly = _disassemble_with_lines(cuobjdump, library, scratch) if line_info else None
    return Side(_dump(cuobjdump, "-sass", library), _dump(cuobjdump, "--dump-resource-usage", library), disassembly)


def _tool_environment(cuobjdump: str) -> dict[str, str]:
    # cuobjdump hands the disassembly to nvdisasm, looked up on PATH: the wheels put it beside cuobjdump.
    return dict(os.environ, PATH=os.pathsep.join([str(Path(cuobjdump).parent), os.environ.get("PATH", "")]))


def _run_tool(command: list[str], **kwargs) -> str:
    dump = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if dump.returncode != 0:
        raise LithosError(
            f"{' '.join(command[:2])} failed: {dump.stderr.strip()} (nvdisasm comes with `pip install "
            "nvidia-cuda-nvdisasm`)"
        )
    return dump.stdout


def _dump(cuobjdump: str, what: str, library: Path) -> str:
    return _run_tool([cuobjdump, what, str(library)], env=_tool_environment(cuobjdump))


def _disassemble_with_lines(cuobjdump: str, library: Path, scratch: Path) -> str:
    """The library's device code through `nvdisasm -g` (cuobjdump's SASS has no source lines): its ELF images
    extracted, then disassembled, code only."""
    env = _tool_environment(cuobjdump)
    nvdisasm = shutil.which("nvdisasm", path=env["PATH"])
    if nvdisasm is None:
        raise LithosError("nvdisasm was not found beside cuobjdump or on PATH: `pip install nvidia-cuda-nvdisasm`")
    with tempfile.TemporaryDirectory(dir=scratch) as images:
        _run_tool([cuobjdump, "-xelf", "all", str(library)], env=env, cwd=images)
        return "".join(_run_tool([nvdisasm, "-g", "-c", str(i)], env=env) for i in sorted(Path(images).glob("*")))


def short(name: str, width: int = 72) -> str:
    return name if len(name) <= width else name[: width // 2 - 2] + "..." + name[-(width // 2 - 1) :]


def report(rows: Sequence[Row], a_label: str, b_label: str, diff_lines: int = 0) -> str:
    lines = [f"a: {a_label}", f"b: {b_label}", ""]
    lines.append(
        f"{'function':74s} {'a instr':>8s} {'b instr':>8s}  regs a/b  global a/b  local a/b  shared a/b  same"
    )
    for row in rows:
        counts = [len(x) if x is not None else "-" for x in (row.a, row.b)]
        regs = "/".join("-" if r is None else str(r) for r in (row.a_registers, row.b_registers))
        ops = [memory_ops(x) if x is not None else None for x in (row.a, row.b)]
        spaces = "  ".join(f"{'/'.join(str(o[space]) if o else '-' for o in ops):>9s}" for space in MEMORY_OPS)
        same = "yes" if row.identical else ("only a" if row.b is None else "only b" if row.a is None else "NO")
        lines.append(f"{short(row.name):74s} {counts[0]!s:>8s} {counts[1]!s:>8s}  {regs:>8s}  {spaces}  {same}")
    differing = [r for r in rows if not r.identical]
    lines.append("")
    lines.append(f"{len(rows) - len(differing)} of {len(rows)} functions identical")
    if diff_lines and differing and differing[0].a is not None and differing[0].b is not None:
        first = differing[0]
        diff = list(difflib.unified_diff(first.a, first.b, "a", "b", n=2, lineterm=""))
        lines += ["", f"first difference, {short(first.name)}:", *diff[:diff_lines]]
    return "\n".join(lines)


def _compile(kernel: str, rev: str, tc: build.Toolchain, scratch: Path) -> Path:
    source = source_tree(rev, scratch) / f"{kernel}.cu"
    if not source.is_file():
        raise LithosError(f"{rev} has no {kernel}.cu; the kernels are {', '.join(build.KERNELS)}")
    library = scratch / f"{kernel}-{len(list(scratch.glob('*.so')))}.so"
    # Quoted includes resolve next to the source first, so each side compiles against its own headers.
    build.compile_library(f"{kernel}.cu at {rev} ({' '.join(tc.defines) or 'no defines'})", source, library, tc)
    return library


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lithos.custom_calls.sass_compare", description=__doc__.split("\n")[0])
    p.add_argument("kernel", help=f"a source under csrc/: {', '.join(build.KERNELS)}")
    p.add_argument("--a", default="HEAD", help="revision of side a ('.' = the working tree; default HEAD)")
    p.add_argument("--b", default=".", help="revision of side b (default: the working tree)")
    p.add_argument("--a-defines", default="", help="NAME=VALUE ... for side a (space- or comma-separated)")
    p.add_argument("--b-defines", default="", help="NAME=VALUE ... for side b")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--opt-level", type=int, default=3, help="3, as the GPU loads it (default), or 0, faster")
    p.add_argument("--match", default="", help="only functions whose name contains this regular expression")
    p.add_argument(
        "--diff", nargs="?", const=60, default=0, type=int, help="show the first differing function's diff (N lines)"
    )
    p.add_argument(
        "--lines",
        nargs="?",
        const=12,
        default=0,
        type=int,
        help="each function's local loads and stores by source line (the N lines with the most; builds with line "
        "tables)",
    )
    args = p.parse_args(argv)
    try:
        cuobjdump = find_cuobjdump()
        sides, labels = [], []
        with tempfile.TemporaryDirectory() as tmp:
            for rev, defines in ((args.a, args.a_defines), (args.b, args.b_defines)):
                names = defines.replace(",", " ").split()
                sides.append(
                    side_sass(args.kernel, rev, names, args.arch, Path(tmp), cuobjdump, args.opt_level, args.lines > 0)
                )
                labels.append(f"{rev} {' '.join(names) or '(no defines)'}")
    except LithosError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a, b = sides
    every = compare(functions(a.sass), functions(b.sass), registers(a.usage), registers(b.usage))
    rows = [r for r in every if re.search(args.match, r.name)]
    print(report(rows, *labels, args.diff))
    if args.lines:
        a_lines, b_lines = (local_access_lines(side.disassembly or "") for side in sides)
        print(lines_report(a_lines, b_lines, [r.name for r in rows], args.lines))
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
