"""How many values one call works on: the one rule behind agoq's piecewise loops.

A loop over pieces bounds its temporaries to a piece whatever the tensor's size. Where the CPU
formulas run (the torch reference or compiled code), a piece is sized to stay within the core's
cache. Where the GPU's kernels run (Triton, on a GPU or under its interpreter), each piece costs a
few kernel launches and nothing is gained from a cache, so a piece is 2^24 values (64 MiB of fp32
temporaries at most): 32K-value pieces would make a 1B model's gradient norm some 190K launches.
Under the interpreter the counts of launches are then the GPU's (benchmarks/launches.py).
"""

from __future__ import annotations

import torch

from agoq.quant import backend

DEVICE_PIECE = 1 << 24


def piece_values(device: torch.device, cpu_values: int) -> int:
    """Values per call on ``device``: ``cpu_values`` where the CPU formulas run, DEVICE_PIECE elsewhere."""
    cpu_formulas = device.type == "cpu" and backend.resolve(device) != "triton"
    return cpu_values if cpu_formulas else DEVICE_PIECE
