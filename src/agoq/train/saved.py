"""Live and peak bytes of the activations autograd keeps for backward, as the run holds them."""

from __future__ import annotations

from typing import Iterable

import torch

from agoq.activation.meter import storage_key, storage_nbytes


class _Held:
    """A saved tensor held by the graph; releases its bytes from the tracker when the graph frees it."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: tuple[str, int] | None, tracker: "SavedActivationTracker") -> None:
        self.tensor = tensor
        self.key = key
        self.tracker = tracker

    def __del__(self) -> None:
        if self.key is not None:
            self.tracker._release(self.key)


class SavedActivationTracker:
    """Context manager counting the bytes held for backward, de-duplicated by storage; keeps the peak.

    A storage saved several times (a tensor and its views) counts once while any saver holds it;
    parameters are excluded (they are not activation memory). The peak spans every forward and
    backward run inside the context, e.g. one pipeline schedule step with its in-flight micro-batches.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._param_storages = {storage_key(p) for p in parameters}
        self._refs: dict[tuple[str, int], int] = {}
        self._sizes: dict[tuple[str, int], int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.start_bytes = 0
        self._hooks = None

    def reset_peak(self) -> None:
        """Start a new peak from the bytes held now."""
        self.peak_bytes = self.live_bytes
        self.start_bytes = self.live_bytes

    @property
    def step_peak_bytes(self) -> int:
        """Peak bytes held for backward by what ran inside the context, above what was held before.

        torch's pipeline keeps the graph of its first-step shape inference alive on the first stage
        (about one micro-batch); it is held before every later step and so is not counted here.
        """
        return self.peak_bytes - self.start_bytes

    def _pack(self, t: torch.Tensor) -> _Held:
        key, nbytes = storage_key(t), storage_nbytes(t)
        if key in self._param_storages or nbytes == 0:
            return _Held(t, None, self)
        if key in self._refs:
            self._refs[key] += 1
        else:
            self._refs[key] = 1
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _release(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= self._sizes.pop(key)

    def __enter__(self) -> "SavedActivationTracker":
        self.reset_peak()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
