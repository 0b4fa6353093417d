"""Number formats for agoq: block-wise quantization with physically packed codes.

Everything in agoq that stores fewer bits (saved activations, gradient buffers, collectives)
calls :func:`quantize` / :func:`dequantize` from here; nothing keeps a second copy of the formulas.
This package imports nothing else from agoq.
"""

from agoq.quant.formats import (
    DEFAULT_ACTIVATION_BLOCK,
    DEFAULT_GRADIENT_BLOCK,
    SCALE_BYTES,
    SCALE_DTYPE,
    QuantFormat,
    parse_format,
)
from agoq.quant.dispatch import dequantize, quantize, quantize_rows_into
from agoq.quant.packing import pack, packed_nbytes, unpack
from agoq.quant.qtensor import NonFiniteError, QTensor, quantization_error_bound

__all__ = [
    "DEFAULT_ACTIVATION_BLOCK",
    "DEFAULT_GRADIENT_BLOCK",
    "SCALE_BYTES",
    "SCALE_DTYPE",
    "NonFiniteError",
    "QTensor",
    "QuantFormat",
    "dequantize",
    "pack",
    "packed_nbytes",
    "parse_format",
    "quantization_error_bound",
    "quantize",
    "quantize_rows_into",
    "unpack",
]
