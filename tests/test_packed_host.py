"""The packed kernels' host-side code (csrc/packed.h) and decoders (packed_decode.h, packed_steps.h), run on the
CPU. For every packed format: the planes lithos.quant lays out pass `packed_weight`'s checks with their own strides
(bytes a row, a row's scales, a layer), and another format's planes are refused with a message; and `Packed<F>`'s
load, decode and scale, the code the kernels run per chunk of 16 weights, give the reference dequantisation's values
bit for bit; so do the megakernel lane ring's steps of 32 codes (`Step32<F>`: the side pieces a step copies beside
its codes, and the dot products read from them). The driver is host code compiled by nvcc (no GPU runs it); the
kernels' loops and copies are checked on the GPU."""

from __future__ import annotations

import subprocess

import jax
import numpy as np
import pytest

from lithos.custom_calls import build
from lithos.custom_calls.packed_weights import FORMAT_CODES, PACKED_FORMATS
from lithos.quant import dequantize, get_format, random_packed

from .test_custom_calls import compiler_toolchain

FFI_TYPES = {"uint8": "U8", "int8": "S8", "float16": "F16", "float32": "F32"}
LAYERS, ROWS, INPUTS = 2, 8, 512

DRIVER = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include "packed.h"
using namespace lithos;
namespace ffi = xla::ffi;

static XLA_FFI_Buffer buffer(ffi::DataType type, int64_t* dims, int64_t rank) {
  static char data[16] __attribute__((aligned(16)));
  XLA_FFI_Buffer b{};
  b.struct_size = sizeof(b);
  b.dtype = static_cast<XLA_FFI_DataType>(type);
  b.data = data;
  b.rank = rank;
  b.dims = dims;
  return b;
}

static void check(const char* name, int32_t code, XLA_FFI_Buffer data, XLA_FFI_Buffer scales, XLA_FFI_Buffer mins,
                  int64_t n_in) {
  PackedWeight w{};
  const ffi::Error error = packed_weight("check", code, ffi::AnyBuffer(&data), ffi::AnyBuffer(&scales),
                                         ffi::AnyBuffer(&mins), 1, n_in, w);
  if (error.failure()) {
    std::printf("%s error %s\n", name, error.message().c_str());
    return;
  }
  std::printf("%s ok %d %d %lld %lld %lld %lld %d\n", name, w.n_out, w.n_in, (long long)w.row_bytes,
              (long long)w.scale_row_bytes, (long long)w.data_outer, (long long)w.scale_outer, w.mins != nullptr);
}

// Every weight of a row from the kernels' decoders and factors: a chunk's decoded codes less the bias they carry
// (kBias, debiased), times kPre and the factor, plus its offset (the kernels sum x * code first and apply both once a
// chunk, the bias through the offset).
template <WeightFormat F>
static void decode_row(const char* name, const uint8_t* data, const uint8_t* scales, const uint8_t* mins, int n_in) {
  using P = Packed<F>;
  const PackedRow row{data, scales, mins};
  std::printf("%s", name);
  for (int col = 0; col < n_in; col += kChunk) {
    float w[kChunk];
    const bool nan = P::decode(P::load(row.data, col), w);
    const ChunkScale s = P::scale(row, col);
    for (int v = 0; v < kChunk; ++v) std::printf(" %a", nan ? NAN : (w[v] - P::kBias) * P::kPre * s.mul + s.add);
  }
  std::printf("\n");
}

// Every weight of a row as the megakernel's lane ring forms it (Step32<F>): a step's codes and the side its pieces
// copy (a 4-byte piece: the aligned word holding its byte; every piece aligned to its size, as cp.async needs),
// then the dot product with each one-hot input. First word: "exact", or "folded" where the codes' bias goes through
// the offset (debiased), which rounds.
template <WeightFormat F>
static void ring_row(const char* name, const uint8_t* data, const uint8_t* scales, int n_in) {
  using S = Step32<F>;
  const PackedRow row{data, scales, nullptr};
  std::printf("%s %s", name, Packed<F>::kBias != 0.0f ? "folded" : "exact");
  for (int k = 0; k < n_in; k += kPackedBlock) {
    uint4 codes;
    if (reinterpret_cast<uintptr_t>(S::codes(data, k)) % 16 != 0) std::printf(" misaligned-codes");
    std::memcpy(&codes, S::codes(data, k), 16);
    SidePiece pieces[S::kPieces];
    S::side_pieces(data, scales, k, pieces);
    uint8_t side[16] = {};
    for (int i = 0, at = 0; i < S::kPieces; at += pieces[i].bytes, ++i) {
      const uintptr_t from = reinterpret_cast<uintptr_t>(pieces[i].from);
      if (pieces[i].bytes != 4 && from % pieces[i].bytes != 0) std::printf(" misaligned-side");
      std::memcpy(side + at, reinterpret_cast<const uint8_t*>(pieces[i].bytes == 4 ? from & ~uintptr_t{3} : from),
                  pieces[i].bytes);
    }
    typename S::Side values;
    std::memcpy(&values, side, sizeof(values));
    for (int v = 0; v < kPackedBlock; ++v) {
      float xf[kPackedBlock] = {};
      xf[v] = 1.0f;
      const float x_sums[2] = {v < kChunk ? 1.0f : 0.0f, v < kChunk ? 0.0f : 1.0f};
      std::printf(" %a", S::dot(codes, values, row, k, xf, x_sums, 0.0f));
    }
  }
  std::printf("\n");
}

static void ring(const char* name, int32_t code, const uint8_t* data, const uint8_t* scales, int n_in) {
  const ffi::Error error = with_weight_format(code, [&](auto format) {
    constexpr WeightFormat F = decltype(format)::value;
    if constexpr (Step32<F>::kSideBytes > 0) ring_row<F>(name, data, scales, n_in);
    return ffi::Error::Success();
  });
  if (error.failure()) std::printf("%s error %s\n", name, error.message().c_str());
}

static void decode(const char* name, int32_t code, const uint8_t* data, const uint8_t* scales, const uint8_t* mins,
                   int n_in) {
  const ffi::Error error = with_weight_format(code, [&](auto format) {
    decode_row<decltype(format)::value>(name, data, scales, mins, n_in);
    return ffi::Error::Success();
  });
  if (error.failure()) std::printf("%s error %s\n", name, error.message().c_str());
}

int main() {
CASES
  return 0;
}
"""


def _buffer(name: str, plane) -> tuple[str, str]:
    """C++ declaring `plane`'s dims and the expression of its buffer (an absent plane: an empty u8 array)."""
    dims = (0,) if plane is None else plane.shape
    dtype = "uint8" if plane is None else np.dtype(plane.dtype).name
    declare = f"  int64_t {name}[] = {{{', '.join(str(d) for d in dims)}}};"
    return declare, f"buffer(ffi::DataType::{FFI_TYPES[dtype]}, {name}, {len(dims)})"


def _case(label: str, code: int, planes: dict, n_in: int) -> str:
    lines, exprs = [], []
    for plane in ("data", "scales", "mins"):
        declare, expr = _buffer(f"{label}_{plane}", planes.get(plane))
        lines.append(declare)
        exprs.append(expr)
    lines.append(f'  check("{label}", {code}, {", ".join(exprs)}, {n_in});')
    return "\n".join(lines)


def _bytes(name: str, plane) -> str:
    if plane is None:
        return f"  const uint8_t* {name} = nullptr;"
    raw = np.ascontiguousarray(plane).view(np.uint8).reshape(-1)
    return f"  alignas(16) static const uint8_t {name}[] = {{{', '.join(str(b) for b in raw)}}};"


def _decode_case(fmt_name: str) -> str:
    """Each row of `_planes(fmt_name)`'s first layer decoded by the driver, as "<format>-<row> values..."."""
    planes = {name: plane[0] for name, plane in _planes(fmt_name).items()}
    lines = []
    for row in range(ROWS):
        label = f"{fmt_name}_{row}"
        scale_row = row // 128 if fmt_name == "fp8_block128" else row
        row_planes = {name: plane[scale_row if name != "data" else row] for name, plane in planes.items()}
        lines += [_bytes(f"{label}_{name}", row_planes.get(name)) for name in ("data", "scales", "mins")]
        args = ", ".join(f"{label}_{name}" for name in ("data", "scales", "mins"))
        lines.append(f'  decode("{label}", {FORMAT_CODES[fmt_name]}, {args}, {INPUTS});')
    return "\n".join(lines)


RING_FORMATS = ("mxfp4", "q4_k", "q5_k", "q6_k", "k_mix", "iq4_nl", "iq4_xs")  # csrc/packed_steps.h Step32


def _ring_case(fmt_name: str) -> str:
    """Each row of `_planes(fmt_name)`'s first layer through the ring's steps, as "<format>_ring_<row> values...": the
    layer's planes as one aligned array each, so that every row and record lies where it would on the GPU."""
    planes = {name: plane[0] for name, plane in _planes(fmt_name).items()}
    lines = [_bytes(f"{fmt_name}_ring_{name}", planes[name]) for name in ("data", "scales")]
    row_bytes = {name: planes[name].nbytes // ROWS for name in ("data", "scales")}
    for row in range(ROWS):
        data, scales = (f"{fmt_name}_ring_{name} + {row * row_bytes[name]}" for name in ("data", "scales"))
        lines.append(f'  ring("{fmt_name}_ring_{row}", {FORMAT_CODES[fmt_name]}, {data}, {scales}, {INPUTS});')
    return "\n".join(lines)


def _planes(fmt_name: str) -> dict:
    w = random_packed(fmt_name, (LAYERS, ROWS, INPUTS), np.random.default_rng(0))
    return jax.tree_util.tree_map(np.asarray, w.planes())


def _differently_shaped(fmt_name: str) -> str:
    """The next format whose data or scale plane differs from `fmt_name`'s in shape or dtype (Q4_0's and Q4_1's,
    say, do not: a plane check cannot tell them apart)."""

    def signature(name):
        return tuple((p.shape, p.dtype) for key, p in _planes(name).items() if key != "mins")

    start = PACKED_FORMATS.index(fmt_name)
    others = PACKED_FORMATS[start + 1 :] + PACKED_FORMATS[:start]
    return next(name for name in others if signature(name) != signature(fmt_name))


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """{label: the driver's line split in words}: the plane checks of every format's own planes and of each
    format given another's, and every row of every format decoded."""
    tc = compiler_toolchain("cuda")
    cases = [_case(name, FORMAT_CODES[name], _planes(name), INPUTS) for name in PACKED_FORMATS]
    for name in PACKED_FORMATS:
        other = _differently_shaped(name)
        cases.append(_case(f"{name}_as_{other}", FORMAT_CODES[name], _planes(other), INPUTS))
    cases += [_decode_case(name) for name in PACKED_FORMATS]
    cases += [_ring_case(name) for name in RING_FORMATS]
    out = tmp_path_factory.mktemp("planes")
    source = out / "driver.cu"
    source.write_text(DRIVER.replace("CASES", "\n".join(cases)))
    binary = out / "driver"
    include = [f"-I{jax.ffi.include_dir()}", f"-I{build.CSRC}"]
    flags = ["-std=c++17", "-O0", "-w"]  # the FFI headers' warnings are not ours
    subprocess.run([tc.compiler, *flags, *include, "-o", str(binary), str(source)], check=True)
    lines = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.splitlines()
    return {line.split()[0]: line.split()[1:] for line in lines}


@pytest.mark.parametrize("fmt_name", PACKED_FORMATS)
def test_every_format_s_planes_are_accepted_with_their_own_strides(checked, fmt_name):
    planes = _planes(fmt_name)
    status, *values = checked[fmt_name]
    assert status == "ok", " ".join(values)
    n_out, n_in, row_bytes, scale_row_bytes, data_outer, scale_outer, has_mins = map(int, values)
    data, scales = planes["data"], planes["scales"]
    assert (n_out, n_in) == (ROWS, INPUTS)
    assert row_bytes == data.shape[-1] * data.itemsize == get_format(fmt_name).data_bytes(INPUTS) * data.itemsize
    assert data_outer == data[0].nbytes and scale_outer == scales[0].nbytes
    scale_rows = scales.shape[1]  # a row's scales; fp8_block128: a row of 128-row tiles
    assert scale_row_bytes == scales[0].nbytes // scale_rows
    assert has_mins == ("mins" in planes)


@pytest.mark.parametrize("fmt_name", PACKED_FORMATS)
def test_another_format_s_planes_are_refused_with_a_message(checked, fmt_name):
    other = _differently_shaped(fmt_name)
    status, *message = checked[f"{fmt_name}_as_{other}"]
    assert status == "error" and message, (fmt_name, other)


@pytest.mark.parametrize("fmt_name", PACKED_FORMATS)
def test_the_kernels_decoders_give_the_reference_values(checked, fmt_name):
    w = random_packed(fmt_name, (LAYERS, ROWS, INPUTS), np.random.default_rng(0))
    expected = np.asarray(dequantize(w, np.float32))[0]
    for row in range(ROWS):
        words = checked[f"{fmt_name}_{row}"]
        assert words[0] != "error", " ".join(words)
        got = np.array([float.fromhex(v) for v in words], np.float32)
        # Bit for bit, but for the sign of zero: the driver adds a chunk's offset to every weight, and + 0.0
        # makes -0 +0 (the kernels add offsets to sums, where it is the same).
        same = (got.view(np.uint32) == expected[row].view(np.uint32)) | ((got == 0) & (expected[row] == 0))
        bad = np.flatnonzero(~same)
        assert not bad.size, (row, bad[:4], got[bad[:4]], expected[row][bad[:4]])


@pytest.mark.parametrize("fmt_name", RING_FORMATS)
def test_the_lane_ring_s_steps_give_the_reference_values(checked, fmt_name):
    """The megakernel's one-token steps of 32 codes (csrc/packed_steps.h Step32): from the pieces of the scale records
    and high bits each step copies beside its codes, every weight as the reference's, bit for bit (but the sign of
    zero); where the codes' bias goes through the offset ("folded", packed_decode.h debiased), within 2^-10 of the
    block's spread (the fold rounds at about 2^-13 of the block's factor, a tenth of the spread of random codes).
    A wrong piece (a record's other word, a half's high bits) or a misaligned copy fails here."""
    w = random_packed(fmt_name, (LAYERS, ROWS, INPUTS), np.random.default_rng(0))
    expected = np.asarray(dequantize(w, np.float32))[0]
    for row in range(ROWS):
        mode, *words = checked[f"{fmt_name}_ring_{row}"]
        assert mode in ("exact", "folded"), mode
        assert not any(word.startswith(("misaligned", "error")) for word in words), " ".join(words[:8])
        got = np.array([float.fromhex(v) for v in words], np.float32)
        same = (got.view(np.uint32) == expected[row].view(np.uint32)) | ((got == 0) & (expected[row] == 0))
        same |= np.isnan(got) & np.isnan(expected[row])
        if mode == "folded":
            spread = np.ptp(expected[row].reshape(-1, 32), axis=1)
            same |= np.abs(got - expected[row]) <= np.repeat(spread, 32) * 2.0**-10
        bad = np.flatnonzero(~same)
        assert not bad.size, (row, bad[:4], got[bad[:4]], expected[row][bad[:4]])
