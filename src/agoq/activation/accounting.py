"""The analytical count of the bytes one decoder layer keeps for backward, by kind.

This is the one formula the benchmark, the memory planner and the pipeline bit allocation use; the
tests check it against :class:`agoq.activation.meter.SavedBytesMeter` to the byte. It describes the
ops of :mod:`agoq.activation.ops` as the LLaMA decoder layer calls them:

- each RMSNorm (two per layer) keeps its input in the compute dtype plus an fp32 rstd per token,
  or, quantized, only the packed input and its fp32 block scales;
- the QKV and FFN1 GEMM inputs (the norm outputs) are kept only by the baseline norm path;
- the attention core (a fused SDPA kernel: torch's CPU flash kernel or CUDA flash) keeps q, k, v
  (k and v with the kv heads only), its output, and an fp32 log-sum-exp per query row;
- the out-projection input is the attention output itself when attention keeps it at full
  precision and the layout makes it a view (``out_proj_input_shared``): zero extra bytes;
- the SwiGLU baseline keeps gate, up and SiLU(gate) (SiLU saves gate; the product saves both
  factors) plus the FFN2 input SiLU(gate) * up; the fused op keeps only packed gate and up.

Unit: U = batch * seq * hidden * 2 bytes (METHOD.md).
"""

from __future__ import annotations

import math

import torch

from agoq.activation.meter import METER_KINDS
from agoq.activation.policy import LayerPrecision
from agoq.quant import QuantFormat

LSE_BYTES = 4  # the fp32 log-sum-exp per (batch, head, query) that fused attention kernels keep
RSTD_BYTES = 4  # the fp32 1/rms per token that the baseline RMSNorm keeps


def U_bytes(batch: int, seq: int, hidden: int) -> int:
    """The paper's unit U = batch * seq * hidden * 2 bytes (one bf16 hidden-size activation)."""
    return batch * seq * hidden * 2


def _kept(shape: tuple[int, ...], itemsize: int, fmt: QuantFormat | None) -> int:
    """Bytes of one saved tensor of ``shape``: plain, or packed codes (rows in whole blocks) + scales."""
    return math.prod(shape) * itemsize if fmt is None else fmt.stored_nbytes(shape)


def layer_saved_bytes(
    batch: int,
    seq: int,
    hidden: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    intermediate: int,
    dtype: torch.dtype,
    precision: LayerPrecision,
    *,
    out_proj_input_shared: bool = True,
) -> dict[str, int]:
    """Bytes one decoder layer keeps for backward, by kind (the keys of METER_KINDS)."""
    for name, value in (
        ("batch", batch),
        ("seq", seq),
        ("hidden", hidden),
        ("n_heads", n_heads),
        ("n_kv_heads", n_kv_heads),
        ("head_dim", head_dim),
        ("intermediate", intermediate),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    es = torch.empty((), dtype=dtype).element_size()
    tokens = batch * seq
    p = precision
    out = dict.fromkeys(METER_KINDS, 0)

    # Two RMSNorms: the baseline keeps input + rstd and its output as the next GEMMs' input.
    if p.norm_input is None:
        out["norm_input"] = 2 * (tokens * hidden * es + tokens * RSTD_BYTES)
        out["gemm_input"] += 2 * tokens * hidden * es
    else:
        out["norm_input"] = 2 * _kept((tokens, hidden), es, p.norm_input)

    # Attention keeps [batch, heads, seq, head_dim] tensors: rows of one head of one token.
    out["attention"] = (
        2 * _kept((tokens * n_heads, head_dim), es, p.attention)  # q and the output
        + 2 * _kept((tokens * n_kv_heads, head_dim), es, p.attention)
        + batch * n_heads * seq * LSE_BYTES
    )

    if p.attention is None and out_proj_input_shared:
        out["out_proj_input"] = 0
    else:
        out["out_proj_input"] = _kept((tokens, n_heads * head_dim), es, p.out_proj_input)

    if p.act_input is None:
        out["act_input"] = 3 * tokens * intermediate * es
        out["gemm_input"] += tokens * intermediate * es
    else:
        out["act_input"] = 2 * _kept((tokens, intermediate), es, p.act_input)
    return out
