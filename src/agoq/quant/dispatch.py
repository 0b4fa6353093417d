"""The public quantize / dequantize: a backend's kernels where they apply, else the torch reference.

:mod:`agoq.quant.backend` says which kernels (compiled CPU code or Triton) serve a device and
format; they give codes and scales bit-identical to :mod:`agoq.quant.qtensor`, the reference,
which serves everything they do not (stochastic rounding, formats they do not cover, and input
holding NaN/Inf under ``nonfinite="raise"``, which the reference reports element by element).
The layering is one-way: dispatch -> backend -> kernels -> qtensor.
"""

from __future__ import annotations

import torch

import agoq.quant.backend as backend
import agoq.quant.qtensor as qtensor
from agoq.quant.formats import QuantFormat
from agoq.quant.qtensor import QTensor, check_dequantize_args, check_quantize_args


# The reference's public signature, repeated: this is the entry point that routes to it or to a backend.
def quantize(
    x: torch.Tensor,
    fmt: QuantFormat | str = "int4",
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    nonfinite: str = "raise",
) -> QTensor:
    """Quantize ``x`` (any shape; fp32/bf16/fp16) block-wise into a packed :class:`QTensor` (see agoq.quant.qtensor).

    ``nonfinite="raise"`` reads the scales on the host to raise where a block held NaN/Inf (on a
    GPU, a wait for the queue); ``"propagate"``, which agoq's own hot paths pass, never does.
    """
    fmt = check_quantize_args(x, fmt, rounding, nonfinite, generator)
    kernels = backend.kernels(x.device, fmt) if rounding == "nearest" else None
    if kernels is not None:
        q = kernels.quantize(x, fmt)
        # A kernel result with NaN scales goes to the reference under "raise": it names the element.
        if nonfinite == "propagate" or not bool(torch.isnan(q.scales).any()):
            return q
    return qtensor.quantize(x, fmt, rounding=rounding, generator=generator, nonfinite=nonfinite)


def quantize_rows_into(x: torch.Tensor, payload_rows: torch.Tensor, scale_rows: torch.Tensor, fmt: QuantFormat) -> None:
    """Quantizes ``x`` ([W, n] values, n whole blocks, contiguous) into ``payload_rows`` ([W, bytes])
    and ``scale_rows`` ([W, n / block]), any row stride (e.g. a collective's wire rows); a block
    holding NaN/Inf gets a NaN scale and unspecified codes (``nonfinite="propagate"``)."""
    kernels = backend.kernels(x.device, fmt)
    if kernels is not None:
        kernels.quantize_rows_into(x, payload_rows, scale_rows, fmt)
        return
    qtensor.quantize_each_row_into(x, payload_rows, scale_rows, fmt, lambda v, f: qtensor.quantize(v, f, nonfinite="propagate"))


def dequantize(q: QTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``q`` represents, in its shape and dtype (or ``dtype``); with ``out``, written there (one pass)."""
    check_dequantize_args(q, dtype, out)
    kernels = backend.kernels(q.device, q.fmt)
    if kernels is not None:
        return kernels.dequantize(q, dtype if out is None else out.dtype, out=out)
    return qtensor.dequantize(q, dtype, out=out)


__all__ = ["dequantize", "quantize", "quantize_rows_into"]
