"""How the 8-bit reduction uses gloo, the one transport tuned here: which all-gather it runs, and
how a caller waits for a short collective. NCCL gets torch's collectives as they are."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from agoq.gradient.nodes import Group


def gathers_by_all_to_all(group: Group = None) -> bool:
    """Whether the 8-bit all-gather runs as one all-to-all of the row sent to every rank.

    gloo's all-gather is a ring of W - 1 dependent rounds; its all-to-all is one round of direct
    sends (benchmarks/gradient_wire.py). Both send each rank's row to
    every other rank once. Across hosts a ring crosses the inter-host link fewer times than direct
    sends, so jobs spread over hosts (LOCAL_WORLD_SIZE below WORLD_SIZE) keep the ring, as does
    NCCL, whose all-gather is the better one on GPUs.
    """
    if dist.get_backend(group) != "gloo":
        return False
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size()))
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) >= world


# Waiting for a short collective on gloo, the caller polls it (yielding its CPU between polls) for
# up to POLL_SECONDS before it sleeps on it. A sleeping caller is woken by gloo's threads once the
# last bytes arrive, and where its CPU went idle meanwhile that wake-up is slow (a VM whose idle
# vCPUs halt wakes late even for an all-to-all of 16 bytes a peer). Polling
# keeps the CPU awake, as NCCL and MPI do. It pays only while the wait is mostly that latency
# (small messages); for large ones, where the peers are still working while one waits, polling
# throughout is slower than sleeping. So only messages of up to POLL_MAX_ROW_BYTES a peer are
# polled for, and never beyond POLL_SECONDS (a late peer). NCCL's waits are left alone: they only
# order CUDA streams and never block the host.
POLL_MAX_ROW_BYTES = 512 << 10
POLL_SECONDS = 0.005
_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))


def polls_for(row_bytes: int, group: Group = None) -> bool:
    """Whether a reduction sending ``row_bytes`` to each peer of ``group`` polls for its collectives before sleeping on them."""
    return POLL_SECONDS > 0 and row_bytes <= POLL_MAX_ROW_BYTES and dist.get_backend(group) == "gloo"


def wait_for(work: dist.Work, poll: bool) -> None:
    """``work.wait()``, polling the work first for up to POLL_SECONDS where ``poll`` (see :func:`polls_for`)."""
    if poll:
        end = time.perf_counter() + POLL_SECONDS
        while not work.is_completed() and time.perf_counter() < end:
            _yield_cpu()
    work.wait()
