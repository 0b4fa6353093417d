"""agoq.quant's properties over random formats, blocks, sizes and magnitudes (hypothesis).

Apart from tests/test_quant.py so that an environment without hypothesis (the GPU machine's image)
skips these two, named, and runs the rest.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from agoq.quant.packing import pack, packed_nbytes, unpack
from tests.test_quant import ALL_FORMATS, FLOAT_DTYPES, _assert_within_bound

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (the dev extra installs it)")
given, settings, st = hypothesis.given, hypothesis.settings, hypothesis.strategies


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(ALL_FORMATS),
    block=st.sampled_from([1, 7, 32, 128, 256]),
    numel=st.integers(1, 2000),
    log_mag=st.floats(-30, 30),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_nearest_error_within_half_step_of_its_block(fmt, block, numel, log_mag, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes inside a tensor (x heavy-tailed), as activations and gradients are.
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 2) * 10.0**log_mag
    x = x.to(dtype)
    if not torch.isfinite(x).all():  # fp16/bf16 overflow at the largest magnitudes
        x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)
    _assert_within_bound(x, f"{fmt}/{block}")


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), numel=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_pack_is_lossless_and_little_endian(bits, numel, seed):
    codes = torch.randint(0, 2**bits, (numel,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    payload = pack(codes, bits)
    assert payload.numel() == packed_nbytes(numel, bits) == math.ceil(numel * bits / 8)
    assert torch.equal(unpack(payload, bits, numel), codes)
    # Layout: code i occupies bits [i*b, (i+1)*b) of the stream, least significant bit first.
    stream = ((codes.numpy()[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    assert np.array_equal(np.packbits(stream, bitorder="little"), payload.numpy())
