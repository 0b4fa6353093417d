"""Triton kernels for agoq.quant (optional extra ``agoq[triton]``): drop-in replacements, tested
against the torch reference.

Importing this package imports triton. Use :mod:`agoq.quant.backend` to choose between these
kernels and the torch path; call the functions here directly only to use a kernel on its own.
"""

from agoq.quant.triton.ops import (
    INTERPRETED,
    MAX_BLOCK,
    accumulate_,
    accumulate_spans_,
    dequantize,
    dequantize_rows,
    dequantize_spans,
    norm_supported,
    quantize,
    quantize_rows_into,
    reduce_rows,
    rms_norm_backward,
    rms_norm_quantize,
    rms_norm_recompute,
    sum_of_squares_spans,
    supports,
    swiglu_backward,
    swiglu_quantize,
    zero_scales_spans_,
)

__all__ = [
    "INTERPRETED",
    "MAX_BLOCK",
    "accumulate_",
    "accumulate_spans_",
    "dequantize",
    "dequantize_rows",
    "dequantize_spans",
    "norm_supported",
    "quantize",
    "quantize_rows_into",
    "reduce_rows",
    "rms_norm_backward",
    "rms_norm_quantize",
    "rms_norm_recompute",
    "sum_of_squares_spans",
    "supports",
    "swiglu_backward",
    "swiglu_quantize",
    "zero_scales_spans_",
]
