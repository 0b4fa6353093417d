"""What agoq chooses differently on a GPU, checked on a CPU: piece sizes by device, phase timings
by CUDA events, and in-flight collectives waited for before their buckets are reused."""

from __future__ import annotations

import pytest
import torch

from agoq.activation.loss import _BLOCK_ELEMENTS, _WeightGradSum
from agoq.gradient import QuantGradBuffer
from agoq.gradient.collectives import EightBitReduction, timed_phase
from agoq.gradient.layout import FOLD_PIECE
from agoq.quant.pieces import DEVICE_PIECE, piece_values


def test_pieces_are_cache_sized_on_a_cpu_and_device_sized_elsewhere():
    assert piece_values(torch.device("cpu"), 1 << 15) == 1 << 15
    assert piece_values(torch.device("meta"), 1 << 15) == DEVICE_PIECE == 1 << 24
    cpu = QuantGradBuffer(torch.nn.Linear(64, 32), microbatches=1)
    assert cpu.layout.piece(torch.device("cpu")) == FOLD_PIECE
    assert cpu.layout.piece(torch.device("cuda", 0)) == DEVICE_PIECE  # whole blocks already


def test_the_lm_head_weight_gradient_goes_in_device_sized_blocks_off_the_cpu():
    # llama3.2-1b's head: 128,256 x 2,048. On a CPU 1,024-row blocks stay in cache (126 blocks, three
    # ops each, per chunk); on a GPU 8,192-row blocks make it 16, where each costs launches, not cache.
    vocab, hidden = 128256, 2048
    assert _WeightGradSum(torch.empty(vocab, hidden, device="meta"), chunks=4).rows == DEVICE_PIECE // hidden == 8192
    assert _WeightGradSum(torch.empty(4096, hidden), chunks=4).rows == _BLOCK_ELEMENTS // hidden == 1024


class _Work:
    """A collective in flight: counts the waits it gets."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def test_reset_waits_for_a_bucket_collective_in_flight_before_zeroing_its_rows():
    buf = QuantGradBuffer(torch.nn.Linear(64, 32), microbatches=1)
    bucket = buf.buckets[0]
    pb = bucket.layout.row_payload_bytes
    bucket.wire[:, pb:].fill_(7)  # nonzero scales, as a step leaves them
    reduction = EightBitReduction.__new__(EightBitReduction)  # one whose all-to-all and all-gather are in flight
    reduction._a2a, reduction._gather_work = _Work(), _Work()
    a2a, gather = reduction._a2a, reduction._gather_work
    reduction._send = reduction._recv = reduction._gathered = bucket.wire
    bucket.reduction = reduction
    bucket.reset()
    assert (a2a.waits, gather.waits) == (1, 1)
    assert reduction._recv is None and reduction._gathered is None  # its buffers released
    assert bucket.reduction is None and bucket.state == "open"
    assert int(bucket.wire[:, pb:].count_nonzero()) == 0


class _Event:
    """torch.cuda.Event's timing surface: each end event is 2.5 ms after its start."""

    recorded: list[object] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.synced = False

    def record(self, stream: object = None) -> None:
        _Event.recorded.append(stream)

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: "_Event") -> float:
        assert end.synced  # read only once the end event is done
        return 2.5


def test_a_gpu_phase_is_timed_by_events_on_its_devices_stream_not_by_the_host_clock(monkeypatch):
    stream = object()
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream if device == torch.device("cuda", 1) else None)
    _Event.recorded = []
    timings: dict[str, float] = {"all_to_all": 1.0}
    with timed_phase(timings, "all_to_all", torch.device("cuda", 1)):
        pass
    assert timings == {"all_to_all": 1.0025} and _Event.recorded == [stream, stream]
    with timed_phase(timings, "reduce", torch.device("cpu")):  # the host clock on a CPU
        pass
    assert 0 <= timings["reduce"] < 1 and _Event.recorded == [stream, stream]


def test_pieces_follow_the_kernels_so_the_interpreter_counts_the_gpus_launches():
    from agoq.quant.backend import triton_available, use_backend

    if not triton_available():
        pytest.skip("triton is not installed (the dev extra installs it): the Triton backend cannot be chosen")
    with use_backend("triton"):
        assert piece_values(torch.device("cpu"), 1 << 15) == DEVICE_PIECE
    with use_backend("torch"):
        assert piece_values(torch.device("cpu"), 1 << 15) == 1 << 15
