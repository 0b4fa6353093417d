"""What a resumed run must share with the checkpoint it continues, its compute dtype included (a
config's ``auto`` keeps the checkpoint's): checked before any worker starts.

Each rank's load checks the same again (agoq.train.checkpoint), but only after the workers have
started, imported torch and joined their process group; the launcher reads the checkpoint's
manifest first and refuses a run that could not load it, in one line naming the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agoq.errors import ConfigError

if TYPE_CHECKING:
    from agoq.launch.config import TrainConfig

NEW_RUN = "or start a new run with --train.out_dir=runs/NAME"


def checkpoint_root(cfg: TrainConfig) -> Path:
    """Where a run's checkpoints live: out_dir/checkpoints."""
    return Path(cfg.train.out_dir) / "checkpoints"


def checkpoint_layout(cfg: TrainConfig) -> dict[str, Any]:
    """The parallel layout a run's checkpoints record, and must be loaded into."""
    p = cfg.parallel
    return {"pp": p.pp, "dp": p.dp, "tp": p.tp, "virtual_stages": p.virtual_stages, "schedule": p.schedule}


def resumed_manifest(cfg: TrainConfig) -> tuple[Path, dict[str, Any] | None] | None:
    """(step folder, its manifest, or None where the folder has no manifest file) of the checkpoint a
    run of ``cfg`` resumes; None when it resumes nothing. A checkpoint or manifest that cannot be read
    is left to its load, which refuses it."""
    if not cfg.checkpoint.resume:
        return None
    from agoq.train.checkpoint import MANIFEST, CheckpointError, latest_checkpoint

    try:
        latest = latest_checkpoint(checkpoint_root(cfg), trust_unverified=cfg.checkpoint.trust_unverified)
        if latest is None:
            return None
        path = latest / MANIFEST
        if not path.exists():
            return latest, None
        manifest = json.loads(path.read_text())
    except (CheckpointError, OSError, ValueError):
        return None
    return (latest, manifest) if isinstance(manifest, dict) else None


def check_resume_job(cfg: TrainConfig) -> None:
    """ConfigError when the checkpoint ``cfg`` resumes holds another model or was saved by another
    parallel layout: one line naming both and the settings that match it."""
    found = resumed_manifest(cfg)
    if found is None or found[1] is None:
        return
    step_dir, manifest = found
    where = f"train.out_dir={cfg.train.out_dir!r} resumes checkpoint {step_dir}"
    saved_layout, layout = manifest.get("layout"), checkpoint_layout(cfg)
    if isinstance(saved_layout, dict) and saved_layout != layout:
        fix = " ".join(f"--parallel.{k}={saved_layout.get(k)}" for k in layout if saved_layout.get(k) != layout[k])
        raise ConfigError(
            f"{where}, saved by the layout {_layout_text(saved_layout)}, but this run is {_layout_text(layout)}; "
            f"resume with that layout ({fix}), {NEW_RUN}"
        )
    saved_model = manifest.get("model_config")
    model = cfg.model_config().to_dict()
    if isinstance(saved_model, dict) and saved_model != model:
        diffs = ", ".join(
            f"{k}={saved_model.get(k)!r} (checkpoint) vs {model.get(k)!r}"
            for k in sorted(set(saved_model) | set(model))
            if saved_model.get(k) != model.get(k)
        )
        preset = ((manifest.get("run_config") or {}).get("model") or {}).get("preset")
        saved = f"model.preset={preset!r}" if isinstance(preset, str) else "the saved model"
        asked = f" (this run: model.preset={cfg.model.preset!r})" if isinstance(preset, str) and preset != cfg.model.preset else ""
        raise ConfigError(f"{where}, which holds another model{asked}: {diffs}; resume with {saved} and its overrides, {NEW_RUN}")


def _layout_text(layout: dict[str, Any]) -> str:
    return (
        f"pp={layout.get('pp')} x dp={layout.get('dp')} x tp={layout.get('tp')} "
        f"({layout.get('schedule')}, virtual_stages={layout.get('virtual_stages')})"
    )


# What a checkpoint's weights are, in the config's words.
_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}


def checkpoint_compute_dtype(cfg: TrainConfig) -> tuple[str, Path] | None:
    """(compute dtype, step folder) of the checkpoint a run of ``cfg`` resumes, or None (not resuming,
    no checkpoint, or one that does not say). Problems with the checkpoint are left to its load."""
    found = resumed_manifest(cfg)
    if found is None:
        return None
    latest, manifest = found
    if manifest is None:
        # No manifest: latest_checkpoint returned it only with the user's consent (trust_unverified),
        # which covers reading DCP's index; the weights' dtype there is the run's.
        from agoq.train.checkpoint import saved_weights_dtype

        saved = _DTYPE_NAMES.get(str(saved_weights_dtype(latest)))
        return (saved, latest) if saved else None
    saved = ((manifest.get("run_config") or {}).get("precision") or {}).get("compute_dtype")
    if saved not in ("bf16", "fp32"):
        saved = _DTYPE_NAMES.get(str(manifest.get("weights_dtype")))
    return (saved, latest) if saved else None


def check_resume_dtype(cfg: TrainConfig) -> None:
    """ConfigError when ``cfg`` sets a compute dtype other than the one of the checkpoint it resumes.

    A bf16 checkpoint holds bf16 weights and fp32 master weights in the optimizer state, an fp32 one
    fp32 weights and no masters: loading either into the other dtype would drop the masters or find
    none, so the run is refused before it starts, naming the saved dtype.
    """
    saved = checkpoint_compute_dtype(cfg)
    asked = cfg.precision.compute_dtype
    if saved is None or asked in ("auto", saved[0]):
        return
    dtype, step_dir = saved
    layout = "bf16 weights with fp32 master weights" if dtype == "bf16" else "fp32 weights without separate master weights"
    raise ConfigError(
        f"precision.compute_dtype={asked} but the checkpoint this run resumes ({step_dir}) was trained in {dtype} ({layout}); "
        f"resume with --precision.compute_dtype={dtype} (or auto, which keeps it), or start a new run with --train.out_dir=runs/NAME"
    )
