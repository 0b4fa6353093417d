"""Count the bytes a forward pass keeps for backward, per decoder layer and per kind of tensor.

:class:`SavedBytesMeter` installs ``saved_tensors_hooks`` for the duration of a forward pass and
sees every tensor autograd saves (plain saved tensors and the payloads and scales the fused LAAQ
ops save). The attention core's quantizing hooks (a quantized policy) pass what they keep through
the hooks that were active outside them, so the meter sees those payloads too.

What is counted is what is really held: the whole storage behind a saved tensor (a view keeps its
whole storage alive), once per storage however many times and through however many views it is
saved. Parameters (and module buffers) are saved too, but they are not activation memory: they are
reported apart. A storage saved by more than one decoder layer (e.g. the rotary tables) belongs to
no single layer and is reported as ``shared``.

Attribution: :func:`meter_scope` marks a region with a layer index and/or a kind; the ops of
:mod:`agoq.activation.ops` set the kind themselves, and the meter can set the layer index through
module hooks (``SavedBytesMeter(model, layers={i: layer})``) so the model needs no change. With no
meter active, :func:`meter_scope` costs one list check.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

# Kinds of saved tensors, in report order. "gemm_input": the input of a GEMM that is not one of the
# kinds above (the QKV and FFN1 inputs, i.e. RMSNorm outputs, and the FFN2 input SiLU(gate) * up).
# "layer_input": what a compressed checkpoint keeps of a checkpointed layer (agoq.activation.checkpoint).
METER_KINDS = ("attention", "norm_input", "act_input", "out_proj_input", "gemm_input", "layer_input", "other")

_active: list["SavedBytesMeter"] = []
_scopes: list[tuple[int | None, str | None]] = []
_NULL = contextlib.nullcontext()


@dataclass
class _StorageRecord:
    nbytes: int
    dtype: torch.dtype
    is_parameter: bool
    scopes: list[tuple[int | None, str]] = field(default_factory=list)


def meter_active() -> bool:
    """Whether a :class:`SavedBytesMeter` is counting now."""
    return bool(_active)


def current_scope() -> tuple[int | None, str]:
    """(layer index or None, kind) of the innermost :func:`meter_scope`; kind 'other' if unset."""
    layer: int | None = None
    kind: str | None = None
    for scope_layer, scope_kind in reversed(_scopes):
        if kind is None and scope_kind is not None:
            kind = scope_kind
        if layer is None and scope_layer is not None:
            layer = scope_layer
        if kind is not None and layer is not None:
            break
    return layer, kind or "other"


@contextlib.contextmanager
def _push_scope(layer: int | None, kind: str | None) -> Iterator[None]:
    _scopes.append((layer, kind))
    try:
        yield
    finally:
        _scopes.pop()


def meter_scope(layer: int | None = None, kind: str | None = None) -> contextlib.AbstractContextManager:
    """Attribute tensors saved inside the block to decoder layer ``layer`` and/or kind ``kind``."""
    if not _active:
        return _NULL
    if kind is not None and kind not in METER_KINDS:
        raise ValueError(f"unknown saved-tensor kind {kind!r}; use one of {', '.join(METER_KINDS)}")
    return _push_scope(layer, kind)


class SavedBytesMeter:
    """Context manager that counts every byte saved for backward during the forward passes inside it.

    ``module``: its parameters and buffers are counted as parameters, not activations (a saved view
    of an ``nn.Parameter`` is recognised without it). ``layers``: decoder layers by index; tensors
    saved inside their forward are attributed to that index. The forward's autograd graph must stay
    alive until the meter is read, since storages are identified by address.
    """

    def __init__(self, module: nn.Module | None = None, layers: Mapping[int, nn.Module] | None = None) -> None:
        self._module = module
        self._layers = dict(layers or {})
        self._records: dict[tuple[str, int], _StorageRecord] = {}
        self._param_keys: set[tuple[str, int]] = set()
        self._handles: list[Any] = []
        self._hooks: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> "SavedBytesMeter":
        if self._module is not None:
            for t in [*self._module.parameters(), *self._module.buffers()]:
                self._param_keys.add(storage_key(t))
        for index, layer in self._layers.items():
            self._handles.append(layer.register_forward_pre_hook(_enter_layer(index)))
            self._handles.append(layer.register_forward_hook(_leave_layer, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t)
        return t

    def _record(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        rec = self._records.get(key)
        if rec is None:
            root = t._base if t._base is not None else t
            is_param = isinstance(root, nn.Parameter) or key in self._param_keys
            rec = _StorageRecord(storage_nbytes(t), t.dtype, is_param)
            self._records[key] = rec
        rec.scopes.append(current_scope())

    # ---- results -------------------------------------------------------------------------------

    def _owner(self, rec: _StorageRecord) -> tuple[str, int | None, str]:
        """('parameter' | 'shared' | 'activation', layer, kind) of one storage."""
        if rec.is_parameter:
            return "parameter", None, "parameter"
        layers = {layer for layer, _ in rec.scopes if layer is not None}
        if len(layers) > 1:
            return "shared", None, "shared"
        layer, kind = rec.scopes[0]
        return "activation", (next(iter(layers)) if layers else layer), kind

    def by_layer(self) -> dict[int | None, dict[str, int]]:
        """Activation bytes by layer index (None: outside every layer) and kind."""
        out: dict[int | None, dict[str, int]] = {}
        for rec in self._records.values():
            what, layer, kind = self._owner(rec)
            if what == "activation":
                row = out.setdefault(layer, {k: 0 for k in METER_KINDS})
                row[kind] = row.get(kind, 0) + rec.nbytes
        return out

    def layer_bytes(self, layer: int | None) -> dict[str, int]:
        """Activation bytes of one layer (None: outside the layers) by kind; zeros if it saved nothing."""
        return self.by_layer().get(layer, {k: 0 for k in METER_KINDS})

    @property
    def shared_bytes(self) -> int:
        """Bytes of storages saved by more than one layer (kept once, belonging to none)."""
        return sum(r.nbytes for r in self._records.values() if self._owner(r)[0] == "shared")

    @property
    def parameter_bytes(self) -> int:
        """Bytes of parameters and buffers that autograd saved (not activation memory)."""
        return sum(r.nbytes for r in self._records.values() if r.is_parameter)

    @property
    def activation_bytes(self) -> int:
        """Every activation byte kept for backward: all layers, outside, and shared."""
        return sum(r.nbytes for r in self._records.values() if not r.is_parameter)

    def summary(self) -> dict[str, Any]:
        """A JSON-ready dict: per-layer bytes by kind, outside, shared, parameters, total."""
        rows = self.by_layer()
        return {
            "layers": {str(k): v for k, v in sorted(((k, v) for k, v in rows.items() if k is not None), key=lambda kv: kv[0])},
            "outside": rows.get(None, {k: 0 for k in METER_KINDS}),
            "shared": self.shared_bytes,
            "parameters": self.parameter_bytes,
            "activation_total": self.activation_bytes,
        }


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _enter_layer(index: int) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        _scopes.append((index, None))

    return hook


def _leave_layer(module: nn.Module, args: Any, output: Any) -> None:
    if _scopes:
        _scopes.pop()


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """(device, storage address) identifying the memory a tensor lives in; views share it."""
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses): count by object
        return "object", id(t)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind a tensor (a saved view keeps all of it alive)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()
