"""How many values one call works on: the one rule behind agoq's piecewise loops and their sizes.

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


def sized_for_kernels(device: torch.device) -> bool:
    """Whether loops over ``device``'s tensors take a GPU's sizes (pieces, chunks, optimizer groups):
    on a GPU, or wherever the Triton kernels run; else the CPU formulas run, sized for the cache."""
    return device.type != "cpu" or backend.resolve(device) == "triton"


def size_key(device: torch.device) -> str:
    """ "device" or "cpu": which entry of a by-device table of sizes applies to ``device`` (see sized_for_kernels)."""
    return "device" if sized_for_kernels(device) else "cpu"


def piece_values(device: torch.device, cpu_values: int) -> int:
    """Values per call on ``device``: ``cpu_values`` where the CPU formulas run, DEVICE_PIECE elsewhere."""
    return DEVICE_PIECE if sized_for_kernels(device) else cpu_values
