"""What a fused custom op passes between its parts, declared once per op.

A ``torch.library`` schema takes flat arguments: tensors, lists of tensors, numbers, lists of
numbers. A fused op with LoRA adapters therefore has a list per adapter field, its autograd keeps
its saved tensors as one flat tuple, and its backward op returns one flat list of gradients.
These helpers are the one place that turns named groups into those flat sequences and back:

- :class:`Layout` names the groups of a flat sequence in order (``"weights*"`` is a list whose
  length travels beside it), for what ``save_for_backward`` keeps and what a backward op returns;
- :class:`SavedAdapter` is one adapter as a backward reads it, and :func:`adapter_arguments` /
  :func:`saved_adapters` turn a list of them into an op's per-field lists and back;
- :func:`arguments_of` binds a fake kernel's arguments by the real op's own signature, so a fake
  does not repeat the parameter list.

An argument added to an op then changes its declaration, not offsets in several places.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from agoq.activation.lora import LoraAdapter


class Layout:
    """The named groups of a flat sequence, in order: ``"name"`` is one item, ``"name*"`` a list."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.lists = tuple(n[:-1] for n in names if n.endswith("*"))

    def flatten(self, **groups: Any) -> tuple[list[Any], tuple[int, ...]]:
        """(the items in order, the length of each list group) of ``groups``, given by name."""
        wanted = {n.rstrip("*") for n in self.names}
        if set(groups) != wanted:
            raise TypeError(f"layout {self.names}: got {sorted(groups)}")
        flat: list[Any] = []
        for name in self.names:
            if name.endswith("*"):
                flat.extend(groups[name[:-1]])
            else:
                flat.append(groups[name])
        return flat, tuple(len(groups[n]) for n in self.lists)

    def unflatten(self, flat: Sequence[Any], lengths: Sequence[int]) -> SimpleNamespace:
        """The groups of ``flat`` by name, each list group of its recorded length."""
        out: dict[str, Any] = {}
        sizes = dict(zip(self.lists, lengths))
        at = 0
        for name in self.names:
            if name.endswith("*"):
                n = sizes[name[:-1]]
                out[name[:-1]] = list(flat[at : at + n])
                at += n
            else:
                out[name] = flat[at]
                at += 1
        if at != len(flat):
            raise ValueError(f"layout {self.names} with lengths {tuple(lengths)} covers {at} items, not {len(flat)}")
        return SimpleNamespace(**out)


@dataclass
class SavedAdapter:
    """One LoRA adapter as a fused op's backward reads it: the adapter, the index of the op's weight
    it adds to, its packed dropout mask from forward, and whether its A and B need gradients."""

    adapter: LoraAdapter
    target: int = 0
    mask: torch.Tensor | None = None
    need_a: bool = False
    need_b: bool = False


# How each adapter field reaches a custom op: the op's argument name and the value of a record.
_ADAPTER_FIELDS: dict[str, Callable[[SavedAdapter], Any]] = {
    "lora_a": lambda s: s.adapter.a,
    "lora_b": lambda s: s.adapter.b,
    "lora_target": lambda s: s.target,
    "lora_scale": lambda s: float(s.adapter.scale),
    "lora_p": lambda s: float(s.adapter.dropout),
    "masks": lambda s: s.mask,
    "need_a": lambda s: bool(s.need_a),
    "need_b": lambda s: bool(s.need_b),
}


def adapter_arguments(adapters: Sequence[SavedAdapter], *fields: str) -> dict[str, list]:
    """The per-field lists of ``adapters`` that a custom op takes, by argument name (``fields``: which)."""
    return {f: [_ADAPTER_FIELDS[f](s) for s in adapters] for f in fields}


def saved_adapters(
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    lora_scale: Sequence[float],
    lora_p: Sequence[float],
    lora_target: Sequence[int] | None = None,
    masks: Sequence[torch.Tensor] | None = None,
    need_a: Sequence[bool] | None = None,
    need_b: Sequence[bool] | None = None,
) -> list[SavedAdapter]:
    """The records a custom op's per-field adapter lists describe (a field not given keeps its default)."""
    return [
        SavedAdapter(
            LoraAdapter(lora_a[i], lora_b[i], lora_scale[i], lora_p[i]),
            0 if lora_target is None else lora_target[i],
            None if masks is None else masks[i],
            False if need_a is None else need_a[i],
            False if need_b is None else need_b[i],
        )
        for i in range(len(lora_a))
    ]


def arguments_of(fn: Callable[..., Any]) -> Callable[..., SimpleNamespace]:
    """A binder of ``fn``'s parameters: called with an op's arguments, it returns them by name."""
    signature = inspect.signature(fn)
    names = tuple(signature.parameters)

    def bind(*args: Any, **kwargs: Any) -> SimpleNamespace:
        # autograd's setup and backward pass every argument by position, once per op call: zip the
        # names there; Signature.bind (ten times the cost) only for keywords or a short call.
        if not kwargs and len(args) == len(names):
            return SimpleNamespace(**dict(zip(names, args)))
        return SimpleNamespace(**signature.bind(*args, **kwargs).arguments)

    return bind
