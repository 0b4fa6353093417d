"""Number formats for agoq: block-wise quantization with physically packed codes.

Everything in agoq that stores fewer bits (saved activations, gradient buffers, collectives)
calls :func:`quantize` / :func:`dequantize` from here; nothing keeps a second copy of the formulas.
This package imports nothing else from agoq.
"""

from agoq.quant.formats import QuantFormat, parse_format
from agoq.quant.dispatch import dequantize, quantize
from agoq.quant.qtensor import NonFiniteError, QTensor, quantization_error_bound

# What a user of the number formats needs; the constants (formats), the row-wise quantizer
# (dispatch) and the bit packing (packing) stay in their modules.
__all__ = [
    "NonFiniteError",
    "QTensor",
    "QuantFormat",
    "dequantize",
    "parse_format",
    "quantization_error_bound",
    "quantize",
]
