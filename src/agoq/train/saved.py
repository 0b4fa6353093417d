"""Live and peak bytes a training step holds: activations kept for backward, and temporaries.

Saved activations are counted through autograd's saved-tensor hooks. Temporaries are every other
tensor the step allocates and frees again (forward intermediates, full-precision gradients before
they fold into the gradient buffer, quantization scratch, loss chunks, communication buffers): they
are counted through a dispatch mode that sees each new storage and a weak reference that sees it
freed. Persistent state (parameters, gradient buffer, optimizer state) exists before the step and
is reported apart.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator

import torch

from agoq.activation.meter import storage_key, storage_nbytes
from agoq.compat import dispatch_mode_base


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in an operator's arguments or results: nested tuples (named ones too), lists
    and dict values, the only containers an aten schema has."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


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
        self._allocations: StepAllocations | None = None

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
            if self._allocations is not None:
                self._allocations._saved(key)
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _release(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= self._sizes.pop(key)
            if self._allocations is not None:
                self._allocations._unsaved(key)

    def is_saved(self, key: tuple[str, int]) -> bool:
        """Whether autograd currently holds this storage for backward."""
        return key in self._refs

    def temporaries(self) -> "StepAllocations":
        """A context counting the step's temporaries (enter it around the whole step)."""
        return StepAllocations(self)

    def __enter__(self) -> "SavedActivationTracker":
        self.reset_peak()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


class StepAllocations(dispatch_mode_base()):
    """Peak bytes of the tensors a step allocates that are not held for backward (its temporaries).

    A storage is new when an operator returns it and none of the operator's inputs lives in it (so
    views and in-place updates of existing tensors are not counted). While autograd holds a new
    storage for backward it counts as a saved activation, not a temporary; when backward releases
    it and something still references it, it counts as a temporary again. Costs a Python call per
    operator, so the trainer enables it for one step.
    """

    def __init__(self, saved: SavedActivationTracker) -> None:
        super().__init__()
        self.saved = saved
        self._sizes: dict[tuple[str, int], int] = {}
        self._refs: dict[tuple[str, int], Any] = {}
        self.live_bytes = 0  # every live storage allocated inside the context
        self.temporary_bytes = 0  # ... of which not held for backward
        self.peak_bytes = 0
        self.peak_temporary_bytes = 0
        self.phase = "step"
        self.peak_temporary_by_phase: dict[str, int] = {}

    def enter_phase(self, name: str) -> None:
        """Attribute the allocations from now on to a named part of the step (e.g. "optimizer")."""
        self._settle_peaks()
        self.phase = name

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {storage_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if isinstance(t, torch.Tensor):
                self._allocated(t, inputs)
        return out

    def _allocated(self, t: torch.Tensor, inputs: set[tuple[str, int]]) -> None:
        key = storage_key(t)
        if key[0] == "object" or key in inputs or key in self._sizes:
            return
        nbytes = storage_nbytes(t)
        if nbytes == 0:
            return
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(t.untyped_storage(), lambda _ref, key=key: self._freed(key))
        self.live_bytes += nbytes
        self.temporary_bytes += nbytes
        self.peak_temporary_by_phase.setdefault(self.phase, 0)
        self._settle_peaks()

    def _settle_peaks(self) -> None:
        # Peaks are taken when memory is allocated, not when backward releases a saved tensor: a
        # released tensor is usually freed right after, and counting it as a temporary in between
        # would report a peak that never existed.
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_temporary_bytes = max(self.peak_temporary_bytes, self.temporary_bytes)
        by_phase = self.peak_temporary_by_phase
        if self.phase in by_phase:  # a phase that allocated nothing has no peak of its own
            by_phase[self.phase] = max(by_phase[self.phase], self.temporary_bytes)

    def _freed(self, key: tuple[str, int]) -> None:
        nbytes = self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        self.live_bytes -= nbytes
        if not self.saved.is_saved(key):
            self.temporary_bytes -= nbytes

    def _saved(self, key: tuple[str, int]) -> None:
        if key in self._sizes:
            self.temporary_bytes -= self._sizes[key]

    def _unsaved(self, key: tuple[str, int]) -> None:
        if key in self._sizes:
            self.temporary_bytes += self._sizes[key]

    def __enter__(self) -> "StepAllocations":
        self.saved._allocations = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._settle_peaks()
        self.saved._allocations = None
