"""lithos.custom_calls.sass_compare: SASS compared function by function, whole functions."""

from __future__ import annotations

import re

import pytest

from lithos.custom_calls import build, sass_compare
from lithos.errors import LithosError

from .conftest import STRICT

# The shape of `cuobjdump -sass` output: a header per function, an instruction line with its address and
# first encoding word, a line with the second word only. The second function's addresses need five digits.
DUMP = """
Fatbin elf code:
================
arch = sm_90a
        code for sm_90a
  Function : _ZN6lithos45_GLOBAL__N__7e6b8b80_12_attention_cu_6dbd765b24attention_combine_kernelILi64EEEvNS0_8AttnArgsE
        .headerflags    @"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                                /* 0x000fe40000000800 */
        /*0010*/              @!P0 LDG.E.128 R4, desc[UR6][R2.64] ;               /* 0x0000000602049981 */
                                                                                /* 0x000ea2000c1e1d00 */
        /*0020*/                   STS [R0], R4 ;                               /* 0x0000000400007388 */
                                                                                /* 0x000fe80000000800 */
        ..........
  Function : _ZN6lithos2mk46_GLOBAL__N__04a1383d_13_megakernel_cu_4524264410megakernelILi1EEEvNS0_4ArgsE
        /*fff0*/                   LDL.64 R8, [R1+0x10] ;                       /* 0x0000100001087983 */
                                                                                /* 0x000e220000100a00 */
        /*10000*/                  STG.E desc[UR4][R2.64], R9 ;                 /* 0x0000000902007986 */
                                                                                /* 0x001fe2000c101904 */
        /*10010*/                  EXIT ;                                       /* 0x000000000000794d */
                                                                                /* 0x000fea0003800000 */
"""


def test_functions_are_read_whole_with_addresses_encodings_and_path_hashes_stripped():
    functions = sass_compare.functions(DUMP)
    assert functions == {
        "_ZN6lithos(anonymous)24attention_combine_kernelILi64EEEvNS0_8AttnArgsE": [
            "LDC R1, c[0x0][0x28] ;",
            "@!P0 LDG.E.128 R4, desc[UR6][R2.64] ;",
            "STS [R0], R4 ;",
        ],
        # Past address 0xffff: a four-digit address pattern would have stopped at the first line.
        "_ZN6lithos2mk(anonymous)10megakernelILi1EEEvNS0_4ArgsE": [
            "LDL.64 R8, [R1+0x10] ;",
            "STG.E desc[UR4][R2.64], R9 ;",
            "EXIT ;",
        ],
    }
    ops = {name: sass_compare.memory_ops(code) for name, code in functions.items()}
    assert list(ops.values()) == [{"global": 1, "local": 0, "shared": 1}, {"global": 1, "local": 1, "shared": 0}]


def test_the_same_source_from_another_path_compares_identical_and_a_change_does_not():
    a = sass_compare.functions(DUMP)
    moved = sass_compare.functions(
        DUMP.replace("7e6b8b80_12_attention_cu_6dbd765b", "0badf00d_12_attention_cu_12345678")
    )
    changed = sass_compare.functions(DUMP.replace("STS [R0], R4", "STS [R0+0x4], R4"))
    assert all(row.identical for row in sass_compare.compare(a, moved))
    rows = sass_compare.compare(a, changed)
    assert [row.identical for row in rows] == [False, True]
    only_a = sass_compare.compare(a, {})
    assert not any(row.identical for row in only_a)
    text = sass_compare.report(rows, "HEAD", ".", diff_lines=20)
    assert "1 of 2 functions identical" in text and "-STS [R0], R4 ;" in text and "+STS [R0+0x4], R4 ;" in text


# `cuobjdump --dump-resource-usage` of the same library: a function's registers on the line after its name.
USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function _ZN6lithos45_GLOBAL__N__7e6b8b80_12_attention_cu_6dbd765b24attention_combine_kernelILi64EEEvNS0_8AttnArgsE:
  REG:127 STACK:0 SHARED:1188 LOCAL:0 CONSTANT[0]:952 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN6lithos2mk46_GLOBAL__N__04a1383d_13_megakernel_cu_4524264410megakernelILi1EEEvNS0_4ArgsE:
  REG:168 STACK:16 SHARED:0 LOCAL:16 CONSTANT[0]:952 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_registers_are_read_per_function_and_reported_beside_the_instructions():
    """Fewer instructions past 128 registers can run slower (run 127): the report shows both sides' registers."""
    code, regs = sass_compare.functions(DUMP), sass_compare.registers(USAGE)
    assert regs == dict(zip(code, [127, 168], strict=True))  # the names as `functions` gives them
    more = sass_compare.registers(USAGE.replace("REG:127", "REG:153"))
    rows = sass_compare.compare(code, code, regs, more)
    assert [(r.a_registers, r.b_registers, r.identical) for r in rows] == [(127, 153, True), (168, 168, True)]
    text = sass_compare.report(rows, "HEAD", ".")
    assert "regs a/b" in text and " 127/153 " in text and " 168/168 " in text
    assert " -/- " in sass_compare.report(sass_compare.compare(code, code), "HEAD", ".")


# `nvdisasm -g -c` of a library built with line tables (dashes shortened): a section line opens each function,
# a file-and-line comment (the innermost line, with the caller it was inlined at) stands above the
# instructions compiled from it.
DISASSEMBLY = """
//---- .text._ZN6lithos2mk46_GLOBAL__N__04a1383d_13_megakernel_cu_4524264410megakernelILi1EEEvNS0_4ArgsE ----
	.align	128
        /*0000*/                   STL [R1+0x70], R3 ;
	//## File "/src/lithos/custom_calls/csrc/mk_attention.h", line 153 inlined at "/src/csrc/megakernel.cu", line 200
        /*0010*/                   LDL R44, [R93] ;
        /*0020*/              @!P1 LDL.64 R8, [R1+0x10] ;
        /*0030*/                   LDS R4, [R0] ;
.L_x_1:
	//## File "/src/lithos/custom_calls/csrc/rowdot.h", line 82
        /*0040*/                   STL.128 [R1], R4 ;
        /*0050*/                   LDG.E R2, desc[UR4][R2.64] ;
//- .text._ZN6lithos45_GLOBAL__N__7e6b8b80_12_attention_cu_6dbd765b24attention_combine_kernelILi64EEEvNS0_8AttnArgsE -
        /*0000*/                   LDL R4, [R1] ;
"""
MEGAKERNEL = "_ZN6lithos2mk(anonymous)10megakernelILi1EEEvNS0_4ArgsE"
COMBINE = "_ZN6lithos(anonymous)24attention_combine_kernelILi64EEEvNS0_8AttnArgsE"


def test_local_accesses_are_counted_at_the_innermost_source_line():
    """The spills' source lines (--lines): each local load or store at the line above it, the caller's line
    ignored, a line's count not carried into the next function."""
    lines = sass_compare.local_access_lines(DISASSEMBLY)
    assert lines == {
        MEGAKERNEL: {"(no line)": 1, "mk_attention.h:153": 2, "rowdot.h:82": 1},
        COMBINE: {"(no line)": 1},
    }
    fewer = sass_compare.local_access_lines(DISASSEMBLY.replace("LDL R44, [R93]", "IMAD R44, R93, R2, RZ"))
    text = sass_compare.lines_report(lines, fewer, [MEGAKERNEL, COMBINE], top=1)
    assert "     2      1  mk_attention.h:153" in text
    assert "     2      2  (2 more)" in text  # the rest: the line without a source and rowdot.h's, on each side
    assert "     4      3  in all" in text and "     1      1  in all" in text
    assert sass_compare.lines_report(lines, fewer, ["no such function"], top=1) == ""


def test_an_unknown_revision_names_the_fix(tmp_path):
    with pytest.raises(LithosError, match="git archive no-such-revision failed: .* name a commit"):
        sass_compare.source_tree("no-such-revision", tmp_path)


def needs_nvcc_and_cuobjdump() -> None:
    try:
        if build.find_compiler("cuda") is None:
            raise LithosError(f"nvcc is not installed ({build.INSTALL_HINT['cuda']})")
        sass_compare.find_cuobjdump()
    except LithosError as e:
        if STRICT:
            pytest.fail(str(e))
        pytest.skip(str(e))


def test_a_define_changes_only_the_kernels_that_read_it(capsys):
    """Compiled for real (unoptimised, to be quick): the tensor-core attention built to head dimension 128
    adds that kernel's instantiation and changes nothing else; a define the attention never reads changes
    nothing. Needs nvcc and cuobjdump (the nvidia-cuda-cuobjdump wheel, a test dependency)."""
    needs_nvcc_and_cuobjdump()
    common = ["attention", "--a", ".", "--opt-level", "0"]
    assert sass_compare.main([*common, "--b-defines", "LITHOS_FUSED_MMA_CHUNKS=2"]) == 0
    assert "functions identical" in capsys.readouterr().out
    assert sass_compare.main([*common, "--b-defines", "LITHOS_ATTENTION_MMA=128"]) == 1
    lines = capsys.readouterr().out.splitlines()
    differing = [line for line in lines if line.endswith(("NO", "only a", "only b"))]
    assert len(differing) == 1 and "mma_kernelILi128E" in differing[0]
    assert differing[0].endswith("only b")


def test_the_spills_by_source_line_add_up_to_the_local_accesses(capsys):
    """Compiled for real with line tables (unoptimised, to be quick, so that its functions spill): every local
    access the SASS holds is counted at a source line (csrc's, or a CUDA header's that they inline)."""
    needs_nvcc_and_cuobjdump()
    assert sass_compare.main(["qk_norm_rope", "--a", ".", "--opt-level", "0", "--lines", "1000"]) == 0
    text = capsys.readouterr().out
    table, _, by_line = text.partition("\nlocal loads and stores by source line")
    assert by_line, "an unoptimised build spills"
    local = {}  # function (shortened as the report does) -> its local accesses in the SASS
    for line in table.splitlines():
        if line.endswith(" yes"):
            fields = line.split()
            local[fields[0]] = int(fields[-3].split("/")[0])
    counted = {}
    for block in by_line.split("\nlocal loads and stores by source line, "):
        name = block.removeprefix(", ").split(":\n")[0]
        rows = [line.split() for line in block.splitlines()[2:]]
        assert all(re.fullmatch(r"[\w.]+:\d+", r[2]) for r in rows if r[2] != "in")
        assert any(r[2].split(":")[0] in {p.name for p in build.CSRC.iterdir()} for r in rows)
        assert all(r[0] == r[1] for r in rows)  # one build on both sides
        counted[name] = int(next(r[0] for r in rows if r[2:] == ["in", "all"]))
    assert counted and all(counted[name] == local[name] for name in counted)
