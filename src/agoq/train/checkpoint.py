"""Atomic, resumable distributed checkpoints on torch.distributed.checkpoint (DCP).

Layout of a checkpoint root::

    root/
      latest                 one line, the name of the newest finished step folder
      step_000120/           a finished checkpoint (kept: the newest ``keep``)
        .metadata            DCP index: every key, its shape and where its bytes lie
        __0_0.distcp ...     DCP data, one file per rank that wrote something
        manifest.json        step, world size, layout, model config, optimizer, each rank's
                             model keys, every file's size and SHA-256; written last
      step_000140.tmp/       a save in progress, or one that crashed: never loaded

A save writes everything into ``step_N.tmp/``; after all ranks have finished, one rank writes the
manifest, renames the folder to ``step_N/`` and replaces ``latest`` (temp file + ``os.replace``),
so a crash at any point leaves the previous checkpoint intact and pointed to. A ``step_N/`` folder
therefore always has its manifest: one without it was altered (the manifest removed) or copied
incompletely, and is refused, never skipped for an older step.

State dict keys are the model's global names (``model.layers.5.attn.q.weight``,
``optim.state.layers.5.attn.q.weight.exp_avg``), so pipeline ranks write disjoint keys and
data-parallel replicas write identical ones, which DCP's planner stores once. Each rank's ``extra``
(RNG states, its data sampler position) is stored under its own key ``extra.rank_NNNNN``.

Integrity and trust: every file's SHA-256 is computed right after the save (each rank hashes a
share of the files) and recorded in the manifest; a load checks every file's size and digest
(again shared among the ranks) before anything is unpickled or read into the model, and refuses a
mismatch with one line naming the file. A checkpoint whose manifest is missing, or lacks the digest of
any file in its folder, cannot be verified and is refused (:class:`UnverifiedCheckpoint`) unless the
caller passes ``trust_unverified=True``. The extra state is read with ``torch.load(weights_only=True)``,
which builds tensors and plain values only. DCP's ``.metadata`` index is itself a pickle, read only
after its digest matched: a folder whose manifest was rewritten along with it is trusted, so a
checkpoint folder must only be writable by whoever is trusted to run code as the training job.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from agoq.nofollow import ensure_folder, refuse_link, write_atomic

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Flattened optimizer keys ("optim.state.<fqn>.exp_avg") make every entry owned by one parameter's
# global name: pipeline ranks never collide, and a layout change is visible key by key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded, with the path and the fix in one line."""


class UnverifiedCheckpoint(CheckpointError):
    """A checkpoint whose files cannot all be checked against digests recorded at save time; loaded only with ``trust_unverified=True``."""

    def __init__(self, step_dir: Path, problem: str) -> None:
        self.step_dir = step_dir
        self.problem = problem  # what is missing, e.g. "has no manifest.json"
        super().__init__(
            f"checkpoint {step_dir} {problem}, so its files cannot be verified; restore the folder from a good copy, "
            f"delete it, or load it unverified with trust_unverified=True"
        )


_NO_MANIFEST = f"has no {MANIFEST} (a save writes it before publishing the folder: it was removed, or the copy is incomplete)"


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint of a step (``step_000123``)."""
    return f"step_{step:06d}"


def checkpoint_step(step_dir: str | os.PathLike) -> int:
    """The step a ``step_NNNNNN`` folder holds (the inverse of :func:`step_dir_name`)."""
    m = _STEP_RE.match(Path(step_dir).name)
    if m is None:
        raise CheckpointError(f"{step_dir} is not a step_NNNNNN checkpoint folder")
    return int(m.group(1))


def latest_checkpoint(root: str | os.PathLike, *, trust_unverified: bool = False) -> Path | None:
    """The newest checkpoint folder under root (the one ``latest`` names, else the highest step), or None.

    Raises :class:`UnverifiedCheckpoint` when that folder has no manifest, unless ``trust_unverified``:
    a published folder always has one, so an older step is never taken in its place.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    chosen = None
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        # A pointer to a folder that vanished (deleted by hand, or a crash while re-saving the same
        # step) must not hide older checkpoints: fall through to the scan.
        if _STEP_RE.match(name) and (root / name).is_dir():
            chosen = root / name
    if chosen is None:
        steps = step_folders(root)
        chosen = steps[-1] if steps else None
    if chosen is not None and not (chosen / MANIFEST).is_file() and not trust_unverified:
        raise UnverifiedCheckpoint(chosen, _NO_MANIFEST)
    return chosen


def step_folders(root: str | os.PathLike) -> list[Path]:
    """Every ``step_NNNNNN`` folder under root, with or without a manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def unverified_files(step_dir: str | os.PathLike) -> list[str]:
    """Files of a checkpoint folder that its manifest records no SHA-256 digest for (every file, manifest missing).

    A load checks the digest of every other file; an empty list means the whole folder is verified.
    """
    step_dir = Path(step_dir)
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    present = sorted(p.name for p in step_dir.iterdir() if p.is_file() and p.name != MANIFEST) if step_dir.is_dir() else []
    if not isinstance(manifest, dict):
        return present
    recorded = manifest.get("sha256") if isinstance(manifest.get("sha256"), dict) else {}
    listed = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    return sorted((set(present) | set(listed)) - set(recorded))


def read_manifest(step_dir: str | os.PathLike) -> dict | None:
    """A checkpoint folder's manifest, or None when it has none; CheckpointError when it cannot be read or is not a JSON object."""
    path = Path(step_dir) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is unreadable ({e}); restore it from a good copy, or delete {step_dir} and load an earlier checkpoint"
        ) from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise CheckpointError(_not_json(e)) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{MANIFEST} is valid JSON but not an object (a {type(manifest).__name__})")
    return manifest


def _not_json(e: ValueError) -> str:
    # A truncated copy or an edit that broke the file: said as such, not as files lacking digests.
    return f"{MANIFEST} is not valid JSON ({e})"


def trained_on(step_dir: str | os.PathLike) -> dict | None:
    """What a checkpoint records its model was trained on (``save_checkpoint``'s ``data``), or None where it does not say."""
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError:
        return None
    data = manifest.get("data") if manifest is not None else None
    return data if isinstance(data, dict) else None


def unverified_problem(step_dir: str | os.PathLike) -> str | None:
    """Why a checkpoint folder cannot be verified, in words ("has no manifest.json ..."), or None when it can."""
    step_dir = Path(step_dir)
    if not (step_dir / MANIFEST).is_file():
        return _NO_MANIFEST
    try:
        read_manifest(step_dir)
    except CheckpointError as e:
        return f"is damaged: {e}"
    missing = unverified_files(step_dir)
    if not missing:
        return None
    return f"has {len(missing)} file{'s' if len(missing) > 1 else ''} without a SHA-256 digest in its {MANIFEST} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"


def remove_checkpoints(root: str | os.PathLike) -> int:
    """Delete every checkpoint under root (step folders, unfinished saves, the pointer); return how many step folders went.

    The folder is renamed aside first, so an interruption leaves either all of them or none where a run looks.
    """
    root = Path(root)
    if not root.exists():
        return 0
    count = len(step_folders(root))
    aside = root.with_name(f".{root.name}.removed.{os.getpid()}")
    if os.path.lexists(aside):
        _remove_tree(aside)
    os.rename(root, aside)
    _fsync_dir(root.parent)
    _remove_tree(aside, ignore_errors=True)
    return count


def capture_rng_state() -> dict[str, Any]:
    """This process's random number generator states (torch CPU and CUDA, Python, NumPy)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, key, pos, has_gauss, gauss = np.random.get_state()
        # As tensors and plain values, so that the checkpoint reads them back without unpickling numpy.
        state["numpy"] = (str(kind), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    except ImportError:  # numpy is a dependency, but RNG capture must not need it
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, key, pos, has_gauss, gauss = state["numpy"]
        key = key.numpy().astype(np.uint32) if isinstance(key, torch.Tensor) else key
        np.random.set_state((kind, key, pos, has_gauss, gauss))


@dataclass
class Checkpointer:
    """Where a run's checkpoints go and what each one records: how many to keep, the parallel
    layout a resume must match, and the run's config and data fingerprints for the manifest."""

    root: Path
    keep: int = 2
    layout: dict | None = None
    config: dict | None = None
    data: dict | None = None

    def save(self, step: int, state: dict[str, Any], extra: dict) -> Path:
        """Save ``state`` (``{"model": ..., "optimizer": ...}``) and ``extra`` as step ``step``."""
        return save_checkpoint(
            self.root, step, state["model"], state["optimizer"], extra, keep=self.keep, layout=self.layout, config=self.config, data=self.data
        )


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any,
    extra: dict,
    *,
    process_group: dist.ProcessGroup | None = None,
    keep: int = 2,
    layout: dict | None = None,
    config: dict | None = None,
    data: dict | None = None,
) -> Path:
    """Write this rank's part of the step's checkpoint atomically; return the finished folder.

    Every rank of ``process_group`` (default: the whole job) must call it. ``model`` is this rank's
    module (or list of pipeline chunks) with global parameter names; ``optimizer`` is a
    ``torch.optim.Optimizer`` over those parameters, any object with ``state_dict`` /
    ``load_state_dict`` keyed by global names, or None; ``extra`` is this rank's own picklable
    state; ``layout`` (e.g. ``{"pp": 2, "dp": 2}``) is checked on load; ``config`` (the run's
    configuration, JSON-able) and ``data`` (what the model was trained on, e.g. fingerprints of
    its corpus and tokenizer, JSON-able: :func:`trained_on` reads it back) are recorded. Keeps the
    newest ``keep`` checkpoints.
    """
    _check_save_arguments(step, keep, extra)
    root = Path(root)
    rank, world = _rank_world(process_group)
    name = step_dir_name(step)
    tmp, final = root / f"{name}.tmp", root / name
    parts, blob = _prepare_save(model, optimizer, extra, rank, root, tmp, process_group)

    # A torch optimizer that has not stepped yet has no state; torch's state_dict helper would
    # create it with a zero-gradient step, which advances AdamW's step count and changes the run.
    stepped = parts.optim_kind != "torch" or bool(optimizer.state)
    msd, osd = parts.state_dicts(optimizer_state=stepped)
    state: dict[str, Any] = {"model": msd, "extra": {_extra_key(rank): blob}}
    if optimizer is not None and stepped:
        state["optim"] = osd
    _write_state(state, tmp, process_group)

    try:
        digests, error = _digest_share(tmp, rank, world), None
    except OSError as e:
        digests, error = {}, f"hashing checkpoint {tmp} failed ({e}); the previous checkpoint is untouched"
    _agree(error, process_group)
    ranks = _gather(_saved_summary(rank, msd, state.get("optim"), digests), process_group)
    error = None
    if rank == 0:
        try:
            _publish(root, tmp, final, step, world, ranks, parts, layout, config, data, keep)
        except OSError as e:
            error = f"publishing checkpoint {final} failed ({e}); the previous checkpoint is still the latest"
    # Nobody returns before the checkpoint is published: a crash right after save_checkpoint
    # returns must find it.
    _agree(error, process_group)
    return final


def _saved_summary(rank: int, msd: dict, osd: dict | None, digests: dict[str, str]) -> dict:
    """What the manifest records of one rank's save: its keys, dtypes, optimizer state and file digests."""
    return {
        **_rank_summary(rank, msd),
        "dtypes": _float_dtypes(msd),
        "optimizer_state": osd is not None,
        # fp32 copies of lower-precision weights in the optimizer state (agoq's MasterWeightOptimizer).
        "master_weights": osd is not None and any(k.rsplit(".", 1)[-1] == "master" for k, _ in _flatten(osd)),
        "sha256": digests,
    }


def _check_save_arguments(step: int, keep: int, extra: dict) -> None:
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    if not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep={keep!r} must be an integer >= 1 (the number of checkpoints to keep)")
    if not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict of this rank's state, got {type(extra).__name__}")


def _prepare_save(
    model: Any, optimizer: Any, extra: dict, rank: int, root: Path, tmp: Path, process_group: dist.ProcessGroup | None
) -> tuple[_Parts, bytes]:
    """(this rank's model and optimizer parts, its extra state as bytes), with the step's temporary
    folder created by rank 0. Every problem found on one rank is agreed on before the first
    collective write, or the other ranks would wait in it forever."""
    parts, blob, error = None, b"", None
    try:
        parts = _Parts(model, optimizer)
        buf = io.BytesIO()
        torch.save(extra, buf)
        blob = buf.getvalue()
        torch.load(io.BytesIO(blob), weights_only=True)  # what load_checkpoint will do: refuse it now, not then
    except CheckpointError as e:
        error = str(e)
    except Exception as e:
        error = (
            f"extra state of rank {rank} cannot be stored as tensors and plain values ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); keep only tensors, numbers, strings, lists, tuples and dicts in it"
        )
    if rank == 0 and error is None:
        try:
            ensure_folder(root)
            refuse_link(tmp)
            if tmp.exists():  # left by a save of this step that crashed
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = f"cannot create checkpoint folder {tmp}: {e}; check that {root} is writable"
        except ValueError as e:  # a symbolic link where the save would write (agoq.nofollow)
            error = str(e)
    _agree(error, process_group)
    assert parts is not None  # _agree raised otherwise
    return parts, blob


def _write_state(state: dict[str, Any], tmp: Path, process_group: dist.ProcessGroup | None) -> None:
    """dcp.save of every rank's state into the step's temporary folder."""
    _run_dcp(
        lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=process_group, no_dist=not _distributed()),
        f"writing checkpoint {tmp}",
        "the previous checkpoint is untouched, fix the cause (disk space, permissions) and save again",
    )


def _run_dcp(call: Callable[[], Any], what: str, fix: str) -> None:
    """Run a dcp.save / dcp.load ``call``; any failure but an interrupt raises CheckpointError "``what`` failed (cause); ``fix``"."""
    try:
        with _quiet_single_process():
            call()
    except (Exception, CheckpointException) as e:
        _reraise_interrupts(e)
        raise CheckpointError(f"{what} failed ({_short(e)}); {fix}") from None


def load_checkpoint(
    root_or_step_dir: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any,
    *,
    process_group: dist.ProcessGroup | None = None,
    layout: dict | None = None,
    trust_unverified: bool = False,
) -> tuple[int, dict]:
    """Load model (and optimizer) state in place from a checkpoint; return (step, this rank's extra).

    ``root_or_step_dir`` is a checkpoint root (its latest step is loaded) or one ``step_N`` folder.
    Every rank must call it. Checks the checkpoint against this job (files complete and their
    SHA-256 digests, world size, layout, model config, keys, shapes and dtypes) before reading any
    tensor, and raises :class:`CheckpointError` on every rank when any rank finds a problem. A
    checkpoint without its manifest, or whose manifest lacks a file's digest, raises
    :class:`UnverifiedCheckpoint` unless ``trust_unverified`` (then the files with digests are
    still verified, the others checked by size where recorded). With ``optimizer=None`` only the
    model is loaded. Gradients of a torch optimizer are cleared.
    """
    rank, world = _rank_world(process_group)
    parts, step_dir, manifest, metadata = _verified(root_or_step_dir, model, optimizer, rank, world, process_group, trust_unverified)

    # Saved before the optimizer's first step: the fresh optimizer already equals the saved one.
    stepped = manifest["ranks"][rank].get("optimizer_state", True) if rank < len(manifest["ranks"]) else True
    if parts.optim_kind == "torch" and stepped:
        # torch fills a fresh optimizer's state with a zero-gradient step only if no gradient is set;
        # otherwise its state dict would be empty and the saved moments silently skipped.
        optimizer.zero_grad(set_to_none=True)
    msd, osd = parts.state_dicts(optimizer_state=stepped)
    try:
        _check_job(step_dir, manifest, rank, world, parts, msd, layout)
        _check_keys(step_dir, manifest, metadata, parts, msd, osd)
        if parts.optim_kind == "stateful":
            osd = _stateful_template(osd, metadata, msd)
        _check_layout(step_dir, manifest, rank, msd, metadata)
        error = None
    except CheckpointError as e:
        error = str(e)
    _agree(error, process_group)

    state: dict[str, Any] = {"model": msd, "extra": {_extra_key(rank): b""}}
    if optimizer is not None and stepped:
        state["optim"] = osd
    _run_dcp(
        lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir), process_group=process_group, no_dist=not _distributed()),
        f"reading checkpoint {step_dir}",
        "its files are damaged: delete that folder and load an earlier checkpoint",
    )
    parts.load(msd, osd if stepped else None)
    return int(manifest["step"]), _read_extra(state["extra"][_extra_key(rank)], rank, step_dir)


def _verified(
    root_or_step_dir: str | os.PathLike,
    model: Any,
    optimizer: Any,
    rank: int,
    world: int,
    process_group: dist.ProcessGroup | None,
    trust_unverified: bool = False,
) -> tuple[_Parts, Path, dict, Any]:
    """(parts, step folder, manifest, dcp metadata), once every rank has found its files complete
    and their checksums right: every file is verified by some rank before any rank unpickles the
    index or reads a tensor."""
    parts, step_dir, manifest, metadata = None, None, None, None
    error: CheckpointError | None = None
    try:
        parts = _Parts(model, optimizer)
        step_dir = _resolve(Path(root_or_step_dir), trust_unverified)
        manifest = _read_manifest(step_dir, trust_unverified, world)
        _check_files(step_dir, manifest)
        _check_digests(step_dir, manifest, rank, world, trust_unverified)
    except CheckpointError as e:
        error = e
    _agree(error, process_group)
    try:
        metadata = _read_metadata(step_dir)
    except CheckpointError as e:
        error = e
    _agree(error, process_group)
    assert parts is not None and step_dir is not None and manifest is not None and metadata is not None
    return parts, step_dir, manifest, metadata


def _read_extra(blob: bytes, rank: int, step_dir: Path) -> dict:
    """This rank's trainer state from its bytes: tensors and plain values only (weights_only)."""
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"the trainer state of rank {rank} in {step_dir} holds more than tensors and plain values "
            f"({type(e).__name__}); it was not written by agoq {FORMAT_VERSION}: delete {step_dir} and load an earlier checkpoint"
        ) from None


# ---------------------------------------------------------------------------------------------
# Internals


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without a process group, although one process is a supported case.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        yield


def _gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _agree(error: str | CheckpointError | None, group: dist.ProcessGroup | None) -> None:
    """Raise the first rank's error on every rank (a lone raise would leave the others hanging); an
    :class:`UnverifiedCheckpoint` stays one, so that callers can tell consent from damage."""
    unverified = (str(error.step_dir), error.problem) if isinstance(error, UnverifiedCheckpoint) else None
    errors = _gather(None if error is None else (str(error), unverified), group)
    for r, e in enumerate(errors):
        if e is not None:
            message, unverified = e
            if unverified is not None:
                raise UnverifiedCheckpoint(Path(unverified[0]), unverified[1])
            raise CheckpointError(message if len(errors) == 1 else f"rank {r}: {message}")


def _extra_key(rank: int) -> str:
    return f"rank_{rank:05d}"


class _Chunks(nn.Module):
    """Several pipeline chunks of one rank seen as one module with their global names."""

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        super().__init__()
        for chunk in chunks:
            for name, child in chunk.named_children():
                mine = self._modules.get(name)
                if mine is None:
                    self.add_module(name, nn.ModuleDict(dict(child.items())) if isinstance(child, nn.ModuleDict) else child)
                elif isinstance(mine, nn.ModuleDict) and isinstance(child, nn.ModuleDict) and not set(mine) & set(child):
                    mine.update(dict(child.items()))
                else:
                    raise ValueError(
                        f"pipeline chunks both hold a submodule named {name!r}; chunks passed together must "
                        "hold disjoint global names (e.g. layers keyed by their global index)"
                    )
            if next(chunk.named_parameters(recurse=False), None) is not None:
                raise ValueError("pipeline chunks with parameters directly on the chunk cannot be merged; wrap them in a submodule")


def _as_one_module(model: nn.Module | Sequence[nn.Module]) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    chunks = list(model)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise TypeError(f"model must be an nn.Module or a list of them, got {model!r}")
    return chunks[0] if len(chunks) == 1 else _Chunks(chunks)


def _plain_module(module: nn.Module) -> bool:
    """Whether the module's state dict is exactly its registered parameters and buffers."""
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    return set(module.state_dict()) <= names


class _Parts:
    """How this rank's model and optimizer enter and leave a DCP state dict.

    Native path: ``get_state_dict`` / ``set_state_dict`` (handles DDP/compile wrappers, shared
    weights, and initialises a fresh optimizer's state so every moment has a tensor to load into).
    Fallback: the objects' own ``state_dict`` / ``load_state_dict`` when the model's state is not
    its registered parameters (e.g. a view over several stages' parameters) or the optimizer steps
    other tensors than the model's (e.g. fp32 master copies); their keys must be global names.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], optimizer: Any) -> None:
        self.module = _as_one_module(model)
        self.optimizer = optimizer
        self.native_model = _plain_module(self.module)
        self.optim_kind: str | None = None
        if optimizer is None:
            return
        if isinstance(optimizer, torch.optim.Optimizer):
            own = {id(p) for p in self.module.parameters()}
            if not self.native_model or any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
                # Its own state_dict is keyed by parameter index: pipeline ranks would collide on
                # "state.0" and DCP would keep only one of them.
                raise CheckpointError(
                    f"the parameters of {type(optimizer).__name__} are not the model's registered parameters; "
                    "pass the nn.Module that holds exactly the optimizer's parameters under their global names"
                )
            self.optim_kind = "torch"
        elif callable(getattr(optimizer, "state_dict", None)) and callable(getattr(optimizer, "load_state_dict", None)):
            self.optim_kind = "stateful"
        else:
            raise CheckpointError(
                f"optimizer {type(optimizer).__name__} has no state_dict/load_state_dict; pass a torch optimizer, "
                "an object with both methods, or None"
            )

    def state_dicts(self, optimizer_state: bool = True) -> tuple[dict, dict]:
        """(model state, optimizer state) as the tensors to save into or load into."""
        if self.native_model:
            msd = get_model_state_dict(self.module, options=_OPTIONS)
        else:
            msd = dict(self.module.state_dict())
        if not optimizer_state:
            return msd, {}
        if self.optim_kind == "torch":
            return msd, get_optimizer_state_dict(self.module, self.optimizer, options=_OPTIONS)
        if self.optim_kind == "stateful":
            return msd, self.optimizer.state_dict()
        return msd, {}

    def load(self, msd: dict, osd: dict | None) -> None:
        """Hand loaded state back to the model and (unless osd is None) the optimizer."""
        if self.optim_kind == "torch" and osd is not None:
            set_state_dict(self.module, self.optimizer, model_state_dict=msd, optim_state_dict=osd, options=_OPTIONS)
            return
        if self.native_model:
            set_model_state_dict(self.module, msd, options=_OPTIONS)
        else:
            self.module.load_state_dict(msd)
        if self.optim_kind == "stateful" and osd is not None:
            self.optimizer.load_state_dict(osd)

    def model_config(self) -> dict | None:
        """The agoq model config of the module, if it carries one."""
        cfgs = [m.cfg for m in self.module.modules() if hasattr(getattr(m, "cfg", None), "to_dict")]
        cfg = cfgs[0] if cfgs else getattr(self.module, "cfg", None)
        return cfg.to_dict() if hasattr(cfg, "to_dict") else None

    def optimizer_name(self) -> str | None:
        """Class of the optimizer, and of the torch optimizer it wraps if any."""
        if self.optimizer is None:
            return None
        name = f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}"
        inner = getattr(self.optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            name += f"[{type(inner).__module__}.{type(inner).__qualname__}]"
        return name


def _float_dtypes(msd: dict) -> list[str]:
    """The dtypes of a model state's floating-point tensors (what it computes in), e.g. ["torch.bfloat16"]."""
    return sorted({str(v.dtype) for v in msd.values() if isinstance(v, torch.Tensor) and v.is_floating_point()})


def _rank_summary(rank: int, msd: dict) -> dict:
    keys = sorted(msd)
    digest = hashlib.sha1("\n".join(f"{k}:{tuple(msd[k].shape)}" for k in keys).encode()).hexdigest()[:16]
    return {
        "rank": rank,
        "model_keys": len(keys),
        "model_numel": sum(int(v.numel()) for v in msd.values()),
        "first_key": keys[0] if keys else None,
        "last_key": keys[-1] if keys else None,
        "keys_digest": digest,
    }


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_tree(path: Path, ignore_errors: bool = False) -> None:
    """Delete a folder of a checkpoint root; a link standing there goes, never what it points to."""
    try:
        if os.path.islink(path):
            os.unlink(path)
        else:
            shutil.rmtree(path)
    except OSError:
        if not ignore_errors:
            raise


def _publish(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    world: int,
    ranks: list[dict],
    parts: _Parts,
    layout: dict | None,
    config: dict | None,
    data: dict | None,
    keep: int,
) -> None:
    """Manifest, rename, pointer, prune: run by one rank after every rank has written its files."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    digests = {name: d for r in ranks for name, d in r.pop("sha256").items()}
    if sorted(digests) != sorted(files):
        raise OSError(f"files changed while the checkpoint was published: hashed {sorted(digests)}, found {sorted(files)}")
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world,
        "layout": layout,
        "model_config": parts.model_config(),
        "optimizer": parts.optimizer_name(),
        "torch_version": torch.__version__,
        "ranks": ranks,
        "files": files,
        "sha256": digests,
        "total_bytes": sum(files.values()),
        # What the weights are and whether fp32 masters stand beside them: a load into another
        # dtype is refused (it would drop the masters, or find none).
        "weights_dtype": "+".join(sorted({d for r in ranks for d in r["dtypes"]})) or None,
        "master_weights": any(r["master_weights"] for r in ranks),
        "run_config": config,
        "data": data,
    }
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, default=str) + "\n")
    _fsync_dir(tmp)
    old = None
    if os.path.lexists(final):  # the same step saved again (e.g. after resuming from it)
        old = final.with_name(final.name + ".old")
        if os.path.lexists(old):
            _remove_tree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    write_atomic(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    if old is not None:
        _remove_tree(old, ignore_errors=True)
    _prune(root, final, keep)


def _finished_steps(root: Path) -> list[tuple[int, Path]]:
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _prune(root: Path, current: Path, keep: int) -> None:
    others = [p for _, p in _finished_steps(root) if p != current]
    for p in others[: max(0, len(others) - (keep - 1))]:
        _remove_tree(p, ignore_errors=True)
    for p in root.iterdir():
        # Leftovers of crashed saves; every rank has finished the current one, so none is live.
        if p.is_dir() and p.name.startswith("step_") and p.name.endswith((".tmp", ".old")):
            _remove_tree(p, ignore_errors=True)


def _resolve(path: Path, trust_unverified: bool = False) -> Path:
    if not path.exists():
        raise CheckpointError(
            f"checkpoint path {path} does not exist; pass a checkpoint root (the folder holding 'latest') or one of its step_NNNNNN folders"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is a file; pass the checkpoint root or a step_NNNNNN folder")
    if path.name.endswith(".tmp"):
        raise CheckpointError(
            f"{path} is an unfinished save (a crash or a save still running); load the root {path.parent} to get the latest finished checkpoint"
        )
    if (path / MANIFEST).is_file() or (path / ".metadata").exists() or _STEP_RE.match(path.name):
        return path
    found = latest_checkpoint(path, trust_unverified=trust_unverified)
    if found is None:
        raise CheckpointError(f"no finished checkpoint under {path} (no step_NNNNNN folder); start without resuming or point to the right folder")
    return found


def _read_manifest(step_dir: Path, trust_unverified: bool = False, world: int = 1) -> dict:
    try:
        manifest, problem = read_manifest(step_dir), _NO_MANIFEST
    except CheckpointError as e:
        manifest, problem = None, f"is damaged: {e}"
    if manifest is None:
        if not trust_unverified:
            raise UnverifiedCheckpoint(step_dir, problem)
        return _stand_in_manifest(step_dir, world)  # a damaged manifest verifies nothing, as a missing one does
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{step_dir / MANIFEST} has format_version {version!r}, this agoq reads {FORMAT_VERSION}; load it with the agoq version that wrote it"
        )
    return manifest


def _stand_in_manifest(step_dir: Path, world: int) -> dict:
    """What a load trusting a folder without its manifest assumes: this job's world, the folder's step
    and files as they are; the rest is checked against DCP's index (keys, shapes, dtypes)."""
    m = _STEP_RE.match(step_dir.name)
    if m is None:
        raise CheckpointError(f"{step_dir} has no {MANIFEST} and is not a step_NNNNNN folder, so its step is unknown; rename it step_NNNNNN")
    files = {p.name: p.stat().st_size for p in sorted(step_dir.iterdir()) if p.is_file()}
    return {
        "format_version": FORMAT_VERSION,
        "step": int(m.group(1)),
        "world_size": world,
        "layout": None,
        "ranks": [],
        "files": files,
        "stand_in": True,
    }


def _check_files(step_dir: Path, manifest: dict) -> None:
    for name, size in manifest["files"].items():
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {step_dir} is missing {name}; copy the whole folder, or delete it and load an earlier checkpoint")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered ({actual} bytes, the save wrote {size}); "
                "copy the whole folder again, or delete it and load an earlier checkpoint"
            )


_HASH_CHUNK = 8 * 2**20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _share(names: list[str], rank: int, world: int) -> list[str]:
    """The files one rank hashes or verifies: every world-th of the sorted names, so the work is split evenly."""
    return sorted(names)[rank::world]


def _digest_share(folder: Path, rank: int, world: int) -> dict[str, str]:
    """SHA-256 of this rank's share of a finished save's files (all ranks' writes are complete)."""
    names = [p.name for p in folder.iterdir() if p.is_file()]
    return {name: _sha256(folder / name) for name in _share(names, rank, world)}


def _check_digests(step_dir: Path, manifest: dict, rank: int, world: int, trust_unverified: bool = False) -> None:
    """Raise unless this rank's share of the files has the digests the save recorded, and (unless
    ``trust_unverified``) every file of the folder has one."""
    recorded = manifest.get("sha256") if isinstance(manifest.get("sha256"), dict) else {}
    if not manifest.get("stand_in") and not trust_unverified:
        problem = unverified_problem(step_dir)
        if problem is not None:
            raise UnverifiedCheckpoint(step_dir, problem)
    for name in _share(list(recorded), rank, world):
        if not (step_dir / name).is_file():
            raise CheckpointError(f"checkpoint {step_dir} is missing {name}; copy the whole folder, or delete it and load an earlier checkpoint")
        if _sha256(step_dir / name) != recorded[name]:
            raise CheckpointError(
                f"checkpoint file {step_dir / name} of step {manifest['step']} is damaged (its SHA-256 differs from the one "
                f"recorded when it was saved); copy the folder again from a good source, or delete {step_dir} to resume from an earlier checkpoint"
            )


def _fmt_shape(shape: Any) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def saved_weights_dtype(step_dir: str | os.PathLike) -> str | None:
    """The dtype of the model weights a checkpoint's DCP index records (e.g. "torch.bfloat16"), or
    None where it cannot say. The index is a pickle: read it only from a verified checkpoint or with
    the user's consent (``trust_unverified``)."""
    try:
        metadata = _read_metadata(Path(step_dir))
    except CheckpointError:
        return None
    dtypes = {str(m.properties.dtype) for k, m in metadata.state_dict_metadata.items() if k.startswith("model.") and hasattr(m, "properties")}
    return dtypes.pop() if len(dtypes) == 1 else None


def _read_metadata(step_dir: Path) -> Any:
    try:
        return dcp.FileSystemReader(step_dir).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint index {step_dir / '.metadata'} is unreadable ({_short(e)}); delete {step_dir} and load an earlier checkpoint"
        ) from None


def _check_job(step_dir: Path, manifest: dict, rank: int, world: int, parts: _Parts, msd: dict, layout: dict | None) -> None:
    """Raise if the job (world size, layout, model config, optimizer) differs from the saved one."""
    if manifest["world_size"] != world:
        saved = f" (layout {manifest['layout']})" if manifest.get("layout") else ""
        raise CheckpointError(
            f"checkpoint {step_dir} was saved by {manifest['world_size']} processes{saved}, this job has {world}; "
            "resume with the same number of processes and the same parallel layout"
        )
    if layout is not None and manifest.get("layout") is not None and dict(layout) != manifest["layout"]:
        raise CheckpointError(
            f"checkpoint {step_dir} was saved with layout {manifest['layout']}, this job uses {dict(layout)}; resume with the saved layout"
        )
    saved_cfg, cfg = manifest.get("model_config"), parts.model_config()
    if saved_cfg is not None and cfg is not None and saved_cfg != cfg:
        diffs = [
            f"{k}={saved_cfg.get(k)!r} (checkpoint) vs {cfg.get(k)!r} (model)"
            for k in sorted(set(saved_cfg) | set(cfg))
            if saved_cfg.get(k) != cfg.get(k)
        ]
        raise CheckpointError(f"checkpoint {step_dir} holds a different model: {', '.join(diffs)}; build the model with the saved config")
    if parts.optimizer is not None and not manifest.get("stand_in"):
        name = parts.optimizer_name()
        if manifest.get("optimizer") is None:
            raise CheckpointError(f"checkpoint {step_dir} holds no optimizer state; load it with optimizer=None and start the optimizer fresh")
        if manifest["optimizer"] != name:
            raise CheckpointError(
                f"checkpoint {step_dir} holds {manifest['optimizer']} state, this job uses {name}; "
                "resume with the saved optimizer, or load with optimizer=None to start it fresh"
            )


def _flatten(value: Any, path: tuple = ()) -> Iterator[tuple[str, Any]]:
    """(DCP key, leaf) pairs of a nested state dict, with the dotted keys DCP's planner uses."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, path + (k,))
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in value):
        for i, v in enumerate(value):
            yield from _flatten(v, path + (i,))
    else:
        yield ".".join(str(p) for p in path), value


def _check_keys(step_dir: Path, manifest: dict, metadata: Any, parts: _Parts, msd: dict, osd: dict) -> None:
    """Raise naming the first model/optimizer key missing from the checkpoint or of another shape."""
    saved = metadata.state_dict_metadata

    def check(sd: dict, prefix: str, what: str) -> None:
        for key, value in _flatten(sd, (prefix,)):
            meta = saved.get(key)
            short = key[len(prefix) + 1 :]
            if meta is None:
                n = sum(1 for k in saved if k.startswith(prefix + "."))
                raise CheckpointError(
                    f"checkpoint {step_dir} has no {what} '{short}' ({n} {what}s saved); load it into the model (and optimizer) it was saved from"
                )
            if isinstance(value, torch.Tensor) and hasattr(meta, "size") and tuple(meta.size) != tuple(value.shape):
                raise CheckpointError(
                    f"{what} '{short}' has shape {_fmt_shape(meta.size)} in checkpoint {step_dir} but "
                    f"{_fmt_shape(value.shape)} here; build the model with the saved config"
                )
            saved_dtype = getattr(getattr(meta, "properties", None), "dtype", None)
            if prefix == "model" and isinstance(value, torch.Tensor) and saved_dtype is not None and saved_dtype != value.dtype:
                # DCP would convert silently: bf16 weights read into fp32 ones leave the fp32 masters
                # behind, fp32 ones read into bf16 find no masters.
                masters = " (its fp32 master weights are in the optimizer state)" if manifest.get("master_weights") else ""
                raise CheckpointError(
                    f"model key '{short}' is {saved_dtype} in checkpoint {step_dir}{masters} but {value.dtype} here; "
                    f"build the model in {saved_dtype}, the dtype it was saved in"
                )

    check(msd, "model", "model key")
    check(osd, "optim", "optimizer key")
    if parts.optim_kind == "torch":
        # The reverse direction: saved moments of this rank's parameters that it would not load.
        prefixes = tuple(f"optim.state.{k}." for k in msd)
        for key in saved:
            if key.startswith(prefixes) and key[len("optim.") :] not in osd:
                raise CheckpointError(
                    f"checkpoint {step_dir} has optimizer state '{key[len('optim.') :]}' that this optimizer lacks; "
                    "resume with the saved optimizer settings"
                )


def _set_path(root: dict, path: tuple, value: Any) -> None:
    node: Any = root
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _stateful_template(own: dict, metadata: Any, msd: dict) -> dict:
    """The object's own state dict plus, from the checkpoint's index, every saved entry it will need.

    A fresh optimizer has no moments yet; its state dict alone would make DCP skip them. Entries
    of parameters held by other ranks are left out, entries of no parameter are shared and kept.
    """
    saved, paths = metadata.state_dict_metadata, metadata.planner_data or {}
    all_params = {path[1] for path in paths.values() if path and path[0] == "model" and len(path) == 2}
    have = {key for key, _ in _flatten(own, ("optim",))}
    template = dict(own)
    for key, path in paths.items():
        if not path or path[0] != "optim" or key in have:
            continue
        owner = path[1] if len(path) > 2 else None
        if owner in all_params and owner not in msd:
            continue
        meta = saved[key]
        value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype) if hasattr(meta, "size") else None
        _set_path(template, path[1:], value)
    return template


def _check_layout(step_dir: Path, manifest: dict, rank: int, msd: dict, metadata: Any) -> None:
    """Raise if this rank holds other model keys than the same rank held when saving."""
    if f"extra.{_extra_key(rank)}" not in metadata.state_dict_metadata:
        raise CheckpointError(f"checkpoint {step_dir} has no extra state for rank {rank}; resume with the saved world size")
    if rank >= len(manifest["ranks"]):  # a trusted folder without its manifest: keys and shapes were checked
        return
    mine, theirs = _rank_summary(rank, msd), manifest["ranks"][rank]
    if mine["keys_digest"] != theirs["keys_digest"]:
        raise CheckpointError(
            f"checkpoint {step_dir} was saved with a different parallel layout: rank {rank} held "
            f"{theirs['model_keys']} model keys ({theirs['first_key']} .. {theirs['last_key']}), here it holds "
            f"{mine['model_keys']} ({mine['first_key']} .. {mine['last_key']}); resume with the saved layout"
            + (f" {manifest['layout']}" if manifest.get("layout") else "")
        )


def dcp_failures(e: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, exception) of each rank's failure that a torch CheckpointException ``e`` carries; [] for any other exception."""
    failures = e.failures if isinstance(e, CheckpointException) else {}
    return [(rank, pair[0] if isinstance(pair, tuple) else pair) for rank, pair in sorted(failures.items())]


def _reraise_interrupts(e: BaseException) -> None:
    """DCP wraps every failure, Ctrl-C and SystemExit included; those must stay what they are."""
    for _, inner in dcp_failures(e):
        if not isinstance(inner, Exception):
            raise inner


def _short(e: BaseException) -> str:
    """The innermost message of a (possibly multi-rank) DCP failure, on one line."""
    failures = dcp_failures(e)
    if failures:
        rank, inner = failures[0]
        text = str(inner).strip().splitlines()
        return f"rank {rank}: {type(inner).__name__}: {text[0] if text else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
