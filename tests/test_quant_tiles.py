"""MXFP4 in fragment tiles (lithos.quant.tiles): the layout against its definition written out as loops,
every value unchanged, and the tensors it refuses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lithos import quant
from lithos.errors import LithosError
from lithos.quant.tiles import PAIR_BITS


def tiles_by_definition(codes_plane: np.ndarray, scales_plane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One matrix's planes `[out, in/2]`, `[out, in/32]` in tiles, bit by bit as the module docstring says."""
    out, half = codes_plane.shape
    k_tiles = 2 * half // 64
    codes = np.zeros(out * half, np.uint8)
    scales = np.zeros(scales_plane.size, np.uint8)

    def code(row, k):
        byte = int(codes_plane[row, k // 2])
        return byte >> 4 if k & 1 else byte & 15

    for tile in range(out // 16):
        for kt in range(k_tiles):
            at = tile * k_tiles + kt
            for lane in range(32):
                g, t = divmod(lane, 4)
                for j in range(4):
                    word = 0
                    for pair in range(4):
                        row, k = 16 * tile + g + 8 * (pair & 1), 64 * kt + 16 * j + 2 * t + 8 * (pair >> 1)
                        for h in range(2):
                            for b in range(4):
                                if (code(row, k + h) >> b) & 1:
                                    word |= 1 << int(PAIR_BITS[pair][4 * h + b])
                    start = 512 * at + 16 * lane + 4 * j
                    codes[start : start + 4] = np.frombuffer(np.uint32(word).tobytes(), np.uint8)
            for g in range(8):
                for i in range(4):
                    scales[32 * at + 4 * g + i] = scales_plane[16 * tile + g + 8 * (i // 2), 2 * kt + i % 2]
    return codes.reshape(codes_plane.shape), scales.reshape(scales_plane.shape)


def random_mxfp4(shape, seed=0, top=quant.tiles.MAX_SCALE_CODE) -> quant.QuantizedArray:
    rng = np.random.default_rng(seed)
    *lead, out, n_in = shape
    scales = rng.integers(100, 140, (*lead, out, n_in // 32), dtype=np.uint8)
    scales.reshape(-1)[:3] = (0, top, 127)  # the smallest scale, the largest the tiles take
    data = rng.integers(0, 256, (*lead, out, n_in // 2), dtype=np.uint8)
    data.reshape(-1)[:2] = (0x80, 0x08)  # negative zeros
    return quant.from_planes("mxfp4", {"data": data, "scales": scales})


def test_tiles_follow_their_definition_and_keep_every_value():
    w = random_mxfp4((2, 32, 128))
    tiled = quant.to_tiles(w)
    assert tiled.format == quant.MXFP4_TILES and tiled.data.shape == w.data.shape and tiled.nbytes == w.nbytes
    for layer in range(2):
        codes, scales = tiles_by_definition(np.asarray(w.data[layer]), np.asarray(w.scales[layer]))
        np.testing.assert_array_equal(np.asarray(tiled.data[layer]), codes)
        np.testing.assert_array_equal(np.asarray(tiled.scales[layer]), scales)
    exact = np.asarray(quant.dequantize(w, jnp.float32))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(tiled, jnp.float32)), exact)
    # Rows of one matrix picked by index (an embedding's lookup) read the same values from either layout.
    matrix, rows = random_mxfp4((32, 128), seed=1), jnp.array([3, 17, 30])
    np.testing.assert_array_equal(np.asarray(quant.to_tiles(matrix)[rows]), np.asarray(matrix[rows]))
    back = quant.from_tiles(tiled)
    assert back.format == quant.MXFP4
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(w.data))
    np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(w.scales))


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_tiles_pair_each_rotation_in_one_lane_group_and_keep_every_value(head_dim):
    """Rotary tiles (Q/K/V): tile q of a head holds rows 8q + g of its first half as tile row g and the rows half
    apart as tile row g + 8, laid out as plain tiles of those rows; the values are the matrix's, row for row."""
    w = random_mxfp4((2, 2 * head_dim, 128), seed=2)
    tiled = quant.to_tiles(w, head_dim)
    assert tiled.format == quant.tiles.rotary_tiles_format(head_dim) and tiled.format.name == "mxfp4_rotary_tiles"
    assert tiled.format.tile == quant.MXFP4_TILES.tile and tiled.nbytes == w.nbytes
    half = head_dim // 2
    for row in range(2 * head_dim):  # the definition, row by row
        head, within = divmod(row, head_dim)
        q, r = divmod(within, 16)
        source = head * head_dim + (8 * q + r if r < 8 else half + 8 * q + r - 8)
        assert quant.tiles.rotary_rows(2 * head_dim, head_dim)[row] == source
    reordered = w.replace(
        data=w.data[:, quant.tiles.rotary_rows(2 * head_dim, head_dim)],
        scales=w.scales[:, quant.tiles.rotary_rows(2 * head_dim, head_dim)],
    )
    plain = quant.to_tiles(reordered)
    np.testing.assert_array_equal(np.asarray(tiled.data), np.asarray(plain.data))
    np.testing.assert_array_equal(np.asarray(tiled.scales), np.asarray(plain.scales))
    np.testing.assert_array_equal(
        np.asarray(quant.dequantize(tiled, jnp.float32)), np.asarray(quant.dequantize(w, jnp.float32))
    )
    back = quant.from_tiles(tiled)
    assert back.format == quant.MXFP4
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(w.data))
    np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(w.scales))
    if head_dim > 16:  # rows that split in tiles but not in heads
        with pytest.raises(LithosError, match=f"heads of {head_dim}"):
            quant.to_tiles(random_mxfp4((3 * head_dim // 2, 128)), head_dim)


@pytest.mark.parametrize(
    "shape, top, message",
    [
        ((24, 128), 192, "tiles of 16 rows x 64 inputs"),
        ((32, 96), 192, "tiles of 16 rows x 64 inputs"),
        ((32, 128), 193, "above 2"),
        ((32, 128), quant.formats.E8M0_NAN, "NaN"),
    ],
)
def test_what_does_not_fit_in_tiles_is_refused(shape, top, message):
    with pytest.raises(LithosError, match=message):
        quant.to_tiles(random_mxfp4(shape, top=top))


def test_only_mxfp4_is_tiled_and_tiled_planes_are_checked():
    with pytest.raises(LithosError, match="made from mxfp4"):
        quant.to_tiles(quant.quantize(np.ones((32, 128), np.float32), "mxfp8"))
    with pytest.raises(LithosError, match="tiles of 16 rows x 64 inputs"):
        quant.from_planes("mxfp4_tiles", {"data": np.zeros((24, 64), np.uint8), "scales": np.zeros((24, 4), np.uint8)})
