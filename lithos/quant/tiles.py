"""MXFP4 in fragment tiles: the same codes and scales, placed where a tensor-core matvec reads them.

A batch-1 MXFP4 matvec over rows as stored decodes each code with several instructions and is bound by
them, not by bandwidth (lithos/custom_calls/NOTES.md, "Tensor cores over weights repacked into fragment
order"). This layout keeps every 4-bit code and 8-bit scale once (the planes have MXFP4's shapes and
sizes; only the places of their bits change), so that one warp load is the A fragments of an mma
m16n8k16 for 16 rows x 64 inputs and a code pair becomes a bf16x2 in one to three integer operations.

Per matrix `[out, in]` (leading axes carried like every plane), tiles of 16 rows x 64 inputs in row-tile
major order, tile `(T, kt)` at index `T * (in / 64) + kt`:

- codes: 512 bytes a tile. Lane `l = 4 g + t` (32 lanes) holds bytes `16 l .. 16 l + 15`: four
  little-endian words, word `j` for inputs `64 kt + 16 j .. + 15`. Its pair `p` (0..3) is the two codes
  (row `16 T + g + 8 (p & 1)`, input `64 kt + 16 j + 2 t + 8 (p >> 1)` and the next), and bit `b` of the
  pair's code `h` (0, 1) sits at word bit `PAIR_BITS[p][4 h + b]`: where a bf16x2 of `value * 2^-126`
  has that code's mantissa, exponent and sign bits (csrc/mxfp4_tiles.h decodes it).
- scales: 32 bytes a tile, the word of lane group `g` (bytes `4 g .. 4 g + 3`) holding the E8M0 codes of
  (row `g`, block `2 kt`), (row `g`, block `2 kt + 1`), (row `g + 8`, block `2 kt`), (row `g + 8`,
  block `2 kt + 1`).

The kernel turns a scale into `2^(c - 65)` by integer arithmetic, exact for codes up to 192 (2^65): `to_tiles`
refuses a tensor with a larger or a NaN scale (the megakernel then keeps its rows).

Rotary tiles (`to_tiles(w, head_dim)`, format mxfp4_rotary_tiles: Q, K and V matrices): the rows of each head are
first reordered so that tile `q` of the head holds rows `8q .. 8q + 7` of its first half as rows `g` and rows
`head_dim/2 + 8q ..` of its second half as rows `g + 8`: a lane then ends a tile with both halves of its rotary
pairs (the megakernel's Q/K/V task rotates them in registers). `from_tiles` puts the rows back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lithos.errors import LithosError
from lithos.quant.formats import MXFP4, MXFP4_TILES, QuantFormat, unpack_nibbles

TILE_ROWS, TILE_INPUTS = 16, 64
MAX_SCALE_CODE = 192  # 2^65: the largest scale the kernel's integer conversion takes exactly
# Word bit of bit b of code h of pair p: PAIR_BITS[p][4 h + b] (mantissa, the two exponent bits, sign). Pair 0
# as a bf16x2 wants them (bits 6, 7, 8, 15 of each half), pairs 1 and 2 three and six places lower, pair 3 in
# the bits left over.
PAIR_BITS = np.array(
    [
        [6, 7, 8, 15, 22, 23, 24, 31],
        [3, 4, 5, 12, 19, 20, 21, 28],
        [0, 1, 2, 9, 16, 17, 18, 25],
        [10, 11, 13, 14, 26, 27, 29, 30],
    ]
)
# PAIR_BITS as [rh, kh, h, b]: pair p = rh + 2 kh (rh: row g or g + 8; kh: inputs 2t or 2t + 8).
_BITS = PAIR_BITS.reshape(2, 2, 2, 4).transpose(1, 0, 2, 3)


def rotary_tiles_format(head_dim: int) -> QuantFormat:
    """The format of Q, K or V rows of heads of `head_dim` in rotary tiles (module docstring)."""
    return dataclasses.replace(MXFP4_TILES, name="mxfp4_rotary_tiles", rotary_head=head_dim)


def tiles_fit(shape: tuple[int, ...], head_dim: int = 0) -> str | None:
    """Why a logical `[..., out, in]` matrix cannot be laid out in tiles (rotary tiles of heads of `head_dim`), or
    None."""
    if len(shape) < 2:
        return f"a tiled matrix needs [out, in] axes, got shape {shape}"
    out, n_in = shape[-2:]
    if out % TILE_ROWS or n_in % TILE_INPUTS:
        return f"[{out}, {n_in}] does not split in tiles of {TILE_ROWS} rows x {TILE_INPUTS} inputs"
    if head_dim and (head_dim % TILE_ROWS or out % head_dim):
        return f"{out} rows do not split in heads of {head_dim} in tiles of {TILE_ROWS} rows"
    return None


def rotary_rows(out: int, head_dim: int) -> np.ndarray:
    """The rotary tiles' row order: entry n is the row (of `out`) that row n of the reordered matrix holds."""
    half = head_dim // 2
    n = np.arange(out)
    head, within = np.divmod(n, head_dim)
    q, r = np.divmod(within, TILE_ROWS)
    return head * head_dim + np.where(r < 8, 8 * q + r, half + 8 * q + r - 8)


def _reorder_rows(w, order: np.ndarray):
    """`w` (MXFP4 planes) with its rows in `order`."""
    return w.replace(data=w.data[..., order, :], scales=w.scales[..., order, :])


def _tile_axes(codes: jax.Array) -> jax.Array:
    """`[..., out, in]` -> `[..., T, kt, g, t, j, rh, kh, h]`: row 16T + 8rh + g, input 64kt + 16j + 8kh + 2t + h."""
    *lead, out, n_in = codes.shape
    c = codes.reshape(*lead, out // 16, 2, 8, n_in // 64, 4, 2, 4, 2)
    n = len(lead)
    T, rh, g, kt, j, kh, t, h = range(n, n + 8)
    return c.transpose(*range(n), T, kt, g, t, j, rh, kh, h)


def _row_axes(c: jax.Array) -> jax.Array:
    """The inverse of `_tile_axes`."""
    *lead, T, KT, _, _, _, _, _, _ = c.shape
    n = len(lead)
    T_, kt, g, t, j, rh, kh, h = range(n, n + 8)
    rows = c.transpose(*range(n), T_, rh, g, kt, j, kh, t, h)
    return rows.reshape(*lead, T * 16, KT * 64)


def _pack(codes: jax.Array) -> jax.Array:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)


def _words_to_bytes(words: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """u32 words -> their little-endian bytes, as a u8 array of `shape`."""
    shifts = jnp.array([0, 8, 16, 24], jnp.uint32)
    return ((words[..., None] >> shifts) & 0xFF).astype(jnp.uint8).reshape(shape)


def _bytes_to_words(data: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    b = data.reshape(*lead, -1, 4).astype(jnp.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


@jax.jit
def _codes_to_tiles(data: jax.Array) -> jax.Array:
    c = _tile_axes(unpack_nibbles(data).astype(jnp.uint32))  # [..., T, kt, g, t, j, rh, kh, h]
    bits = jnp.asarray(_BITS, jnp.uint32)
    word = jnp.zeros(c.shape[:-3], jnp.uint32)
    for b in range(4):
        word = word | jnp.sum(((c >> b) & 1) << bits[..., b], axis=(-3, -2, -1), dtype=jnp.uint32)
    return _words_to_bytes(word, data.shape)


@jax.jit
def _codes_from_tiles(data: jax.Array) -> jax.Array:
    *lead, out, half = data.shape
    words = _bytes_to_words(data, tuple(lead)).reshape(*lead, out // 16, half // 32, 8, 4, 4)
    bits = jnp.asarray(_BITS, jnp.uint32)
    w = words[..., None, None, None]
    c = sum(((w >> bits[..., b]) & 1) << b for b in range(4))  # [..., T, kt, g, t, j, rh, kh, h]
    return _pack(_row_axes(c))


def _swap_scale_axes(scales: jax.Array, first: int, second: int) -> jax.Array:
    """`[..., out, blocks]` read as `[..., T, first, 8, second, 2]` with its axes 1 and 3 swapped: rows (rh, g)
    and k tiles kt to tile order (first = 2) and back (second = 2). Its own inverse."""
    *lead, out, blocks = scales.shape
    n = len(lead)
    s = scales.reshape(*lead, out // 16, first, 8, second, 2)
    return s.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4).reshape(scales.shape)


def _scales_to_tiles(scales: jax.Array) -> jax.Array:
    return _swap_scale_axes(scales, 2, scales.shape[-1] // 2)  # [..., T, rh, g, kt, blk] -> [T, kt, g, rh, blk]


def _scales_from_tiles(scales: jax.Array) -> jax.Array:
    return _swap_scale_axes(scales, scales.shape[-1] // 2, 2)  # [..., T, kt, g, rh, blk] -> [T, rh, g, kt, blk]


def to_tiles(w, head_dim: int = 0):
    """An MXFP4 QuantizedArray `[..., out, in]` in fragment tiles (format mxfp4_tiles), or in rotary tiles of heads
    of `head_dim` rows (`rotary_tiles_format`): the same values. Raises when it does not fit (`tiles_fit`) or a
    scale is NaN or above 2^65."""
    if w.format != MXFP4:
        raise LithosError(f"fragment tiles are made from mxfp4 weights, not {w.format.name}")
    why = tiles_fit(w.shape, head_dim)
    if why is None and bool(jnp.any(w.scales > MAX_SCALE_CODE)):
        why = f"a scale is NaN or above 2^{MAX_SCALE_CODE - 127} (the tiled kernel's exact range)"
    if why is not None:
        raise LithosError(f"mxfp4 {list(w.shape)} cannot be laid out in fragment tiles: {why}")
    fmt = MXFP4_TILES
    if head_dim:
        w, fmt = _reorder_rows(w, rotary_rows(w.shape[-2], head_dim)), rotary_tiles_format(head_dim)
    return w.replace(data=_codes_to_tiles(w.data), scales=_scales_to_tiles(w.scales), format=fmt)


def from_tiles(w):
    """The inverse of `to_tiles`: MXFP4 rows as stored."""
    rows = w.replace(data=_codes_from_tiles(w.data), scales=_scales_from_tiles(w.scales), format=MXFP4)
    if w.format.rotary_head:
        rows = _reorder_rows(rows, np.argsort(rotary_rows(w.shape[-2], w.format.rotary_head)))
    return rows
