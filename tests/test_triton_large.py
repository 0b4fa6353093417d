"""The Triton kernels past 2^31 values, where int32 element or byte offsets would wrap.

On a GPU each kernel runs on 2^31 + 5 values (a tail block short of whole, about 20 GiB at most
at once), and the blocks at both ends and across the 2^31 boundary are compared bit for bit with
the torch reference on CPU: block-wise quantization is local, so a slice's reference is the
reference of the whole. Without a GPU the same code runs under Triton's interpreter at
AGOQ_TEST_LARGE_NUMEL values (2^17 + 5 unless set): it checks the test, not the offsets. The GPU check
(benchmarks/gpu/run.sh) runs this file on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("AGOQ_TEST_TRITON_DEVICE", "cuda") == "cuda"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'agoq[triton]')")

import agoq.quant.triton as tq  # noqa: E402
from agoq.quant import QTensor, backend, dequantize, parse_format, quantize  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
if not ON_GPU and not tq.INTERPRETED:
    pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module; run these tests in their own process", allow_module_level=True)
N = int(os.environ.get("AGOQ_TEST_LARGE_NUMEL", 0)) or (2**31 + 5 if ON_GPU else 2**17 + 5)
BOUNDARY = 2**31 if N > 2**31 else N // 2  # the value where int32 offsets wrap (on the GPU)


def _need(gib: float) -> None:
    if ON_GPU:
        free, _ = torch.cuda.mem_get_info(DEVICE)
        if free < gib * 2**30:
            pytest.skip(f"needs {gib:.0f} GiB of free GPU memory for {N} values, {free / 2**30:.1f} GiB free")


def _slices(n: int, block: int) -> list[tuple[int, int]]:
    """Whole-block ranges at the start, across BOUNDARY, and at the end of ``n`` values (the last one partial)."""
    across = (BOUNDARY // block - 4) * block
    last = (n - 1) // block * block - 4 * block
    return [(0, 8 * block), (across, across + 8 * block), (last, n)]


@pytest.mark.parametrize("name", ("int8/256", "int4"))
def test_quantize_and_dequantize_past_2_31_values_equal_the_reference_at_both_ends_and_the_boundary(name: str) -> None:
    fmt = parse_format(name)
    _need(8 + 1 + 8 + 1)  # fp32 input, codes, fp32 output, scales and slack
    x = torch.randn(N, device=DEVICE)
    q = tq.quantize(x, fmt)
    refs = []
    for a, b in _slices(N, fmt.block_size):
        with backend.use_backend("torch"):
            ref = quantize(x[a:b].cpu(), fmt)
        nb, pb = -(-(b - a) // fmt.block_size), fmt.payload_bytes(a)
        codes = q.payload[pb : pb + ref.payload.numel()]
        scales = q.scales[a // fmt.block_size : a // fmt.block_size + nb]
        assert torch.equal(codes.cpu(), ref.payload), f"codes of values {a}..{b} differ"
        assert torch.equal(scales.cpu(), ref.scales), f"scales of values {a}..{b} differ"
        refs.append(ref)
    del x
    y = tq.dequantize(q, torch.float32)
    del q
    for (a, b), ref in zip(_slices(N, fmt.block_size), refs):
        with backend.use_backend("torch"):
            want = dequantize(ref, torch.float32)
        assert torch.equal(y[a:b].cpu(), want), f"values {a}..{b} differ"


def test_reduce_rows_past_2_31_payload_bytes_sums_every_row_in_order() -> None:
    # Three rows whose bytes together pass 2^31: the third row starts beyond an int32 byte offset.
    fmt = parse_format("int8/256")
    w, block = 3, fmt.block_size
    c = max(block, -(-N // w) // block * block)
    _need(w * c / 2**30 + 4 * c / 2**30 + 1)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    payload = torch.randint(0, 256, (w, fmt.payload_bytes(c)), dtype=torch.uint8, device=DEVICE, generator=gen)
    scales = torch.rand(w, c // block, device=DEVICE, generator=gen) * 1e-2
    acc, _ = tq.reduce_rows(payload, scales, fmt, average=False)
    for a, b in [(0, 8 * block), ((c // block - 8) * block, c)]:
        want = None
        for r in range(w):
            row = QTensor(
                payload[r, fmt.payload_bytes(a) : fmt.payload_bytes(b)].cpu(),
                scales[r, a // block : b // block].cpu(),
                torch.Size([b - a]),
                torch.float32,
                fmt,
            )
            with backend.use_backend("torch"):
                v = dequantize(row, torch.float32)
            want = v if want is None else want + v
        assert torch.equal(acc[a:b].cpu(), want), f"sums of values {a}..{b} differ"
