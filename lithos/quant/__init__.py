"""Low-precision weights kept packed: formats, their exact reference dequantisation, converters from
checkpoint layouts, quantizers, and the quality report of a quantized model.

    from lithos.quant import quantize, dequantize
    w_q = quantize(w, "mxfp4")            # QuantizedArray: data u8 [out, in/2], scales u8 [out, in/32]
    w_ref = dequantize(w_q)               # exact values, [out, in]

Models accept a `QuantizedArray` wherever a weight matrix goes (`linear`, the embedding lookup, the
LM head); the reference path dequantises it, the kernels will read the planes directly.
"""

from lithos.quant.formats import (
    FORMATS,
    FP8_BLOCK128,
    IQ4_NL,
    IQ4_XS,
    K_MIX,
    MXFP4,
    MXFP4_TILES,
    MXFP8,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QuantFormat,
    QuantizedArray,
    as_dense,
    bytes_by_format,
    dequantize,
    dequantize_params,
    describe_formats,
    format_name,
    from_planes,
    get_format,
    is_quantized,
    scale_by_e8m0,
    unpack_nibbles,
    with_dtype,
)
from lithos.quant.layouts import GGUF_FORMATS, from_fp8_block_scaled, from_gguf, from_gpt_oss_mxfp4
from lithos.quant.quantize import DEFAULT_GROUPS, GROUPS, names_for_groups, quantize, quantize_mx, quantize_params
from lithos.quant.synthetic import random_packed, random_packed_init, random_packed_like, random_packed_params
from lithos.quant.tiles import from_tiles, tiles_fit, to_tiles

__all__ = [
    "DEFAULT_GROUPS",
    "FORMATS",
    "FP8_BLOCK128",
    "K_MIX",
    "GGUF_FORMATS",
    "GROUPS",
    "MXFP4",
    "MXFP4_TILES",
    "MXFP8",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q5_0",
    "Q5_1",
    "Q5_K",
    "IQ4_NL",
    "IQ4_XS",
    "Q2_K",
    "Q3_K",
    "Q6_K",
    "Q8_0",
    "QuantFormat",
    "QuantizedArray",
    "as_dense",
    "bytes_by_format",
    "describe_formats",
    "dequantize",
    "dequantize_params",
    "format_name",
    "from_fp8_block_scaled",
    "from_gguf",
    "from_gpt_oss_mxfp4",
    "from_planes",
    "from_tiles",
    "get_format",
    "is_quantized",
    "names_for_groups",
    "quantize",
    "quantize_mx",
    "quantize_params",
    "random_packed",
    "random_packed_init",
    "random_packed_like",
    "random_packed_params",
    "scale_by_e8m0",
    "tiles_fit",
    "to_tiles",
    "unpack_nibbles",
    "with_dtype",
]
