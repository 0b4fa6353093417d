"""A whole training run: launch the ranks, train, evaluate, checkpoint, summarise."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from agoq.models.config import parameter_count_text
from agoq.launch.choices import ResolvedChoices, cpu_cores
from agoq.launch.config import ConfigError, TrainConfig
from agoq.launch.forkserver import (
    die_with_launcher,
    inherited_gloo_interface,
    raise_deferred_interrupt,
    LauncherOutput,
    start_method,
    stray_rank_variables,
    under_torchrun,
    unnamed_locks,
    workers_environment,
)
from agoq.launch.lock import LOCK_NAME, join_run_lock, run_lock
from agoq.train.metrics import peak_rss_bytes, plot_run, summary_markdown, summary_text
from agoq.nofollow import ensure_folder, open_in_place, refuse_link, write_atomic
from agoq.launch.resume import checkpoint_layout, checkpoint_root


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _describe(cfg: TrainConfig) -> str:
    p, pr = cfg.parallel, cfg.precision
    return (
        f"model {cfg.model.preset}, pp={p.pp} x dp={p.dp}{f' x tp={p.tp}' if p.tp > 1 else ''} ({p.schedule}, {_count(p.microbatches, 'micro-batch', 'micro-batches')}), "
        f"activations {pr.activations} ({pr.activation_format}, stage bits {pr.stage_bits}), gradients {pr.gradients}, "
        f"{cfg.train.steps} steps of {cfg.data.batch_size} x {cfg.data.seq_len} tokens"
    )


# The train loss a summary quotes is the mean over this many last steps: one step's loss is noisy
# (on the default run it swings by +-0.2 nats from step to step).
LOSS_WINDOW = 10


def run_figures(records: list[dict[str, Any]], timed: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """A run's headline figures: smoothed and last train loss, validation loss, throughput.

    The losses are those of the steps that trained: a skipped step (a non-finite loss or gradient,
    the weights left as they were) is counted in ``skipped_steps`` instead, and its loss, often NaN,
    in no mean (None where no step trained). ``tokens_per_s`` is tokens per step over the mean step
    time of the ``timed`` steps, so that it and ``step_time_s`` always agree (a mean of per-step
    rates would not).
    """
    losses = [r["loss"] for r in records if not r.get("skipped") and math.isfinite(r["loss"])]
    window = losses[-LOSS_WINDOW:]
    step_time = sum(r["step_time_s"] for r in timed) / len(timed)
    return {
        "train_loss": sum(window) / len(window) if window else None,
        "train_loss_window": len(window),
        "skipped_steps": len(records) - len(losses),
        "final_loss": losses[-1] if losses else None,
        "min_train_loss": min(losses, default=None),
        "val_loss": next((r["val_loss"] for r in reversed(records) if r.get("val_loss") is not None), None),
        "tokens_per_s": tokens_per_step / step_time,
        "step_time_s": step_time,
        "tokens_per_step": tokens_per_step,
        "steps": records[-1]["step"],
    }


class _DeferredInterrupt:
    """A Ctrl-C that lands inside a callback Python runs from C (a weakref's, as the step's allocation
    meter uses) cannot propagate: Python prints "Exception ignored in ..." with a traceback and goes on.
    Installed in each worker, this keeps such an interrupt and raises it between steps instead."""

    pending = False

    @classmethod
    def install(cls) -> None:
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if issubclass(unraisable.exc_type, KeyboardInterrupt):
                cls.pending = True
            else:
                previous(unraisable)

        sys.unraisablehook = hook

    @classmethod
    def raise_pending(cls) -> None:
        if cls.pending:
            cls.pending = False
            raise KeyboardInterrupt


def train_worker(cfg: TrainConfig, choices: ResolvedChoices | None = None, group_ready: Callable[[], object] | None = None) -> dict[str, Any]:
    """Entry point of every rank; rank 0 returns the run summary, the others their records and stats.

    ``choices`` are the launcher's decisions for the config's ``auto`` values; without them (under
    torchrun) the workers decide (agoq.launch.components.worker_choices). ``group_ready`` is called
    once this rank has joined the process group.
    """
    from agoq.launch.components import build_run
    from agoq.train.trainer import measure_baseline

    run = build_run(cfg, choices, group_ready)
    trainer = run.trainer
    ctx = trainer.ctx
    if choices is None and ctx.rank == 0:  # decided by the workers: rank 0 says which and why
        _say_choices(run.choices)
    _resume(trainer, cfg, run.data, data_checked=choices is not None)
    records = trainer.train(after_step=lambda rec: _DeferredInterrupt.raise_pending())
    # After training, so torch's one-off first-step shape inference is behind both measurements.
    baseline = measure_baseline(trainer) if cfg.train.baseline and cfg.precision.activations != "bf16" else None
    mine = _rank_stats(trainer, records, baseline)
    gathered: list[Any] = [None] * ctx.world
    dist.all_gather_object(gathered, mine)
    summary = None
    if ctx.rank == 0 and records:
        summary = summarize(cfg, run.choices, run.model_cfg, records, gathered, baseline is not None)
        _write_summary(cfg, summary)
    trainer.metrics.close()
    dist.barrier()
    if ctx.owns_group:
        dist.destroy_process_group()
    return summary if ctx.rank == 0 else {"rank": ctx.rank, "records": records, "stats": mine}


def _resume(trainer: Any, cfg: TrainConfig, data: Any, data_checked: bool = False) -> None:
    """Continue from the newest checkpoint when resuming (or, with checkpoint.overwrite, delete the old
    ones first), and drop metrics rows of the steps this run will (re)do. ``data_checked``: the
    local launcher found the checkpoint trained on this run's data (:func:`check_resume_data`)."""
    ck = cfg.checkpoint
    if ck.resume:
        from agoq.train.checkpoint import latest_checkpoint, load_checkpoint, unverified_problem

        latest = latest_checkpoint(checkpoint_root(cfg), trust_unverified=ck.trust_unverified)
        if latest is not None and not data_checked:  # under torchrun, no launcher of agoq's looked before the workers started
            check_resume_data(cfg, data, notice=trainer.ctx.rank == 0)
        if latest is not None:
            state = trainer.checkpoint_state()
            step, extra = load_checkpoint(
                latest, state["model"], state["optimizer"], layout=checkpoint_layout(cfg), trust_unverified=ck.trust_unverified
            )
            trainer.load_extra(step, extra)
            if trainer.ctx.rank == 0:
                # "verified" only where the load hashed every file of the folder against its digest.
                problem = unverified_problem(latest)
                checked = (
                    "every file's checksum verified"
                    if problem is None
                    else f"NOT verified: it {problem}; loaded because checkpoint.trust_unverified=true"
                )
                print(f"agoq train: resuming from {latest} (step {step} of {cfg.train.steps}; {checked})", flush=True)
    elif ck.overwrite:
        from agoq.train.checkpoint import remove_checkpoints

        if trainer.ctx.rank == 0:
            removed = remove_checkpoints(checkpoint_root(cfg))
            if removed:
                print(
                    f"agoq train: deleted {removed} checkpoint(s) of the earlier run in {checkpoint_root(cfg)} (checkpoint.overwrite=true)",
                    flush=True,
                )
        dist.barrier()  # no rank saves into the folder while it is being deleted
    trainer.metrics.keep_until(trainer.step)


def _rank_stats(trainer: Any, records: list[dict[str, Any]], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """This rank's memory and communication figures for the summary."""
    ctx = trainer.ctx
    # The first step also holds the graph of torch's shape inference; later steps do not.
    measured = records[1:] or records
    probe = next((r for r in records if r.get("memory_probe")), {})
    mine = {
        "rank": ctx.rank,
        "pp_rank": ctx.pp_rank,
        "dp_rank": ctx.dp_rank,
        "tp_rank": ctx.tp_rank,
        "stages": ctx.stages,
        "layer_bits": trainer.components.layer_bits,
        "peak_saved_bytes": max((r["peak_saved_bytes"] for r in measured), default=0),
        "peak_temporary_bytes": probe.get("peak_temporary_bytes"),
        "peak_temporary_bytes_by_phase": probe.get("peak_temporary_bytes_by_phase"),
        "peak_step_bytes": probe.get("peak_step_bytes"),
        "wire_bytes_per_step": trainer.sync.wire_bytes_last_step,
        "fp32_wire_bytes_per_step": trainer.sync.fp32_wire_bytes(),
        # Activations and their gradients between the tp ranks: sequence all-gathers and
        # reduce-scatters, the 4-bit norm inputs gathered in backward, the loss's all-reduces.
        "tp_wire_bytes_per_step": measured[-1].get("tp_wire_bytes", 0) if measured else 0,
        # The dp bytes by link class, where the reduction knows its nodes (hier-8/4).
        "link_bytes_per_step": measured[-1].get("link_bytes", {}) if measured else {},
        "grad_buffer_bytes": trainer.sync.buffer_bytes(),
        "optimizer_bytes": trainer.optimizer.state_bytes(),
        "param_bytes": sum(p.numel() * p.element_size() for _, p in trainer.params),
        "param_count": sum(p.numel() for _, p in trainer.params),
        "peak_tensor_bytes": None,
        "peak_rss_bytes": peak_rss_bytes(),
        "baseline_peak_saved_bytes": None if baseline is None else baseline["peak_saved_bytes"],
    }
    if mine["peak_step_bytes"] is not None:
        # Close to what a GPU's max_memory_allocated reports, counted on any device: the persistent
        # state plus the step's joint peak of saved activations and temporaries (small persistent
        # buffers, such as the pipeline's receive buffers, are not included).
        mine["peak_tensor_bytes"] = mine["param_bytes"] + mine["grad_buffer_bytes"] + mine["optimizer_bytes"] + mine["peak_step_bytes"]
    return mine


def summarize(
    cfg: TrainConfig, choices: ResolvedChoices, model: Any, records: list[dict[str, Any]], ranks: list[dict[str, Any]], with_baseline: bool
) -> dict[str, Any]:
    """The run summary (summary.json): what ran (the config with its ``auto`` choices decided, and
    ``model``, the LlamaConfig trained, with the tokenizer's vocabulary), its figures, every rank's
    stats, the bf16 baseline, every step."""
    # The first step includes one-time setup; the memory probe step counts every allocation.
    timed = [r for r in records[1:] if not r.get("memory_probe")] or records
    base = None
    if with_baseline:
        base = {"ranks": {str(g["rank"]): {"peak_saved_bytes": g["baseline_peak_saved_bytes"]} for g in ranks}}
    run = run_figures(records, timed, cfg.data.batch_size * cfg.data.seq_len)
    return {
        "description": _describe(cfg),
        "config": choices.config_dict(cfg),
        "model": dataclasses.asdict(model),
        "run": run,
        "ranks": ranks,
        "baseline": base,
        "records": records,
    }


def _write_summary(cfg: TrainConfig, summary: dict[str, Any]) -> None:
    """summary.json, summary.md and loss.png in out_dir, and the summary on the terminal."""
    out = Path(cfg.train.out_dir)
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_atomic(out / "summary.md", summary_markdown(summary) + "\n")
    title = f"agoq train: {cfg.model.preset}, {cfg.precision.activations} activations, {cfg.precision.gradients} gradients"
    drawn = plot_run(summary, out / "loss.png", title)
    print("\n" + summary_text(summary), flush=True)
    plot = f"{drawn} (loss and memory), " if drawn else ""
    print(
        f"\nwritten: {out / 'summary.json'} (everything), {out / 'summary.md'} (the table as markdown), "
        f"{plot}{out / 'metrics'}/rank*.jsonl (every step)",
        flush=True,
    )
    if drawn is None:
        print("agoq train: no loss.png: matplotlib is not installed (pip install 'agoq[plot]')", flush=True)


def check_data(cfg: TrainConfig, train_tokens: int, val_tokens: int, tokenizer_vocab: int | None = None) -> None:
    """ConfigError unless the corpus holds at least one step's batch for training and one for
    validation, and the model has an embedding row for every id of the tokenizer (``tokenizer_vocab``)."""
    d = cfg.data
    if tokenizer_vocab is not None and tokenizer_vocab > cfg.model_config().vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer_vocab} ids, more than the model's vocabulary {cfg.model_config().vocab_size}; set data.vocab_size={tokenizer_vocab}"
        )
    batch = d.batch_size * (d.seq_len + 1)  # each sequence also needs its next-token targets
    if train_tokens < batch:
        raise ConfigError(
            f"data.corpus={d.corpus!r} gives {train_tokens} training tokens, fewer than one batch of "
            f"data.batch_size={d.batch_size} x (data.seq_len={d.seq_len} + 1) = {batch}; use a larger corpus or smaller batches"
        )
    # Validation batches are global batches of windows that share their boundary token.
    val_batch = d.batch_size * d.seq_len + 1
    if cfg.uses_validation() and val_tokens < val_batch:
        raise ConfigError(
            f"data.corpus={d.corpus!r} leaves {val_tokens} validation tokens at data.val_fraction={d.val_fraction}, "
            f"fewer than one batch of data.batch_size={d.batch_size} x data.seq_len={d.seq_len} + 1 = {val_batch}; "
            "raise data.val_fraction, or set train.eval_every=0 and train.baseline=false"
        )


def announce(cfg: TrainConfig, processes: str, choices: ResolvedChoices | None = None) -> None:
    """The run's opening lines: what will run, where, in which precision (``choices`` where decided
    already, else the config's values), and where its output goes."""
    p, pr, d = cfg.parallel, cfg.precision, cfg.data
    dtype, quant = (choices.compute_dtype, choices.quant_backend) if choices else (pr.compute_dtype, pr.quant_backend)
    out = Path(cfg.train.out_dir)
    print(
        f"agoq train: model {cfg.model.preset} ({parameter_count_text(cfg.model_config().num_parameters())}), {processes}: pp={p.pp} x dp={p.dp}"
        + (f" x tp={p.tp} (sequence parallel)" if p.tp > 1 else "")
        + f" "
        f"({p.schedule}, {_count(p.microbatches, 'micro-batch', 'micro-batches')} per step)\n"
        f"agoq train: activations {pr.activations}"
        + (f" ({pr.activation_format}, stage bits {pr.stage_bits})" if pr.activations != "bf16" else "")
        + f", gradients {pr.gradients}, optimizer {cfg.optim.name}, compute {dtype}, quantization {quant}\n"
        f"agoq train: {cfg.train.steps} steps of {d.batch_size} x {d.seq_len} tokens"
        + (", then one bf16-policy step to measure the baseline" if cfg.train.baseline and pr.activations != "bf16" else "")
        + f"; output in {out}/ (summary.json, summary.md, loss.png, metrics/"
        + (", checkpoints/" if cfg.checkpoint.every else "")
        + ")",
        flush=True,
    )
    from agoq.launch.environment import unread_notice

    unread = unread_notice()
    if unread:
        print(unread, flush=True)
    if under_torchrun():
        return
    cores = cpu_cores()
    if cfg.world_size > cores and not torch.cuda.is_available():
        print(
            f"agoq train: {cfg.world_size} processes share {cores} CPU core{'s' if cores > 1 else ''} here, so they take turns and each "
            "step takes longer than the layout suggests; a layout of fewer processes (parallel.pp x dp x tp) runs faster on this machine",
            flush=True,
        )
    stray = stray_rank_variables()
    if stray:
        found = ", ".join(f"{k}={v}" for k, v in stray.items())
        print(
            f"agoq train: {found} in the environment ignored: no launcher started this process (torchrun sets "
            "TORCHELASTIC_RUN_ID; others RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT); each local worker gets its own",
            flush=True,
        )
    iface = inherited_gloo_interface()
    if iface:
        print(
            f"agoq train: GLOO_SOCKET_IFNAME={iface} from the environment: gloo's connections between the workers "
            "use that interface, not loopback; unset it to keep them on loopback",
            flush=True,
        )


def finished_run(cfg: TrainConfig) -> int | None:
    """The step of the newest checkpoint when it already reaches train.steps (so resuming would train nothing), else None.

    Run before any worker starts, it also refuses (ConfigError, one line naming the fix) what would
    load an unverifiable checkpoint, resume another model, layout or compute dtype than the checkpoint's, or mix
    a fresh run's checkpoints with an earlier run's in the same folder.
    """
    from agoq.train.checkpoint import UnverifiedCheckpoint, checkpoint_step, latest_checkpoint, step_folders, unverified_problem

    ck, root = cfg.checkpoint, checkpoint_root(cfg)
    if not ck.resume:
        old = step_folders(root)
        if old and not ck.overwrite:
            raise ConfigError(
                f"train.out_dir={cfg.train.out_dir!r} holds checkpoints of an earlier run (newest {old[-1].name}) and checkpoint.resume=false "
                "would mix them with this run's; choose a new folder (--train.out_dir=runs/NAME) or delete them first (--checkpoint.overwrite=true)"
            )
        return None
    try:
        latest = latest_checkpoint(root, trust_unverified=ck.trust_unverified)
    except UnverifiedCheckpoint as e:
        raise ConfigError(_unverified_line(e.step_dir, e.problem)) from None
    if latest is None:
        return None
    problem = unverified_problem(latest)
    if problem is not None and not ck.trust_unverified:
        raise ConfigError(_unverified_line(latest, problem))
    from agoq.launch.resume import check_resume_dtype, check_resume_job

    check_resume_job(cfg)
    check_resume_dtype(cfg)
    step = checkpoint_step(latest)
    return step if step >= cfg.train.steps else None


def _unverified_line(step_dir: Path, problem: str) -> str:
    return (
        f"checkpoint {step_dir} {problem}, so its files cannot be verified; restore the folder from a good copy, "
        "delete it to resume from an earlier checkpoint, or load it anyway with --checkpoint.trust_unverified=true"
    )


def report_finished(cfg: TrainConfig, step: int) -> dict[str, Any] | None:
    """Say that the run in train.out_dir is complete, show its summary again, and how to start a fresh one."""
    out = Path(cfg.train.out_dir)
    print(f"agoq train: the run in {out}/ is already complete: its newest checkpoint is step {step} of train.steps={cfg.train.steps}.")
    summary = None
    path = out / "summary.json"
    try:
        summary = json.loads(path.read_text())
        print("\n" + summary_text(summary) + "\n")
    except (OSError, ValueError, KeyError) as e:
        print(f"agoq train: its summary ({path}) cannot be shown: {e}")
    print(
        "agoq train: to train again, choose a new folder (--train.out_dir=runs/NAME), start over in this one, deleting its checkpoints "
        "(--checkpoint.resume=false --checkpoint.overwrite=true), or train further (--train.steps=N with N > " + str(step) + ")",
        flush=True,
    )
    return summary


class _NativeStderrToLog:
    """The worker's stderr (fd 2) into ``path`` until :meth:`restore`: while it joins the process group.

    A peer that dies while the group forms (a Ctrl-C to one worker) leaves the others retrying their
    connections to it in gloo's C++, which writes a line per retry to stderr until the launcher
    stops them; the launcher's one line says what happened, and these go to the rank's logs.
    """

    def __init__(self, path: Path) -> None:
        self.path, self.saved = path, None
        try:
            fd = open_in_place(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except (OSError, ConfigError):
            return  # stderr stays where it is
        sys.stderr.flush()
        self.saved = os.dup(2)
        os.dup2(fd, 2)
        os.close(fd)

    def restore(self) -> None:
        if self.saved is None:
            return
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.saved = None
        try:
            if self.path.stat().st_size == 0:
                self.path.unlink()
        except OSError:
            pass


class _RankLog:
    """``out_dir/logs/rank<R>.log`` (a failure's traceback) and ``rank<R>.error`` (its time and last line).

    Both are opened, and space for them reserved, when the worker starts: a failure on a full disk
    (ENOSPC) must still be written down, and it is the one failure that leaves no room to write.
    A worker that succeeds removes them.
    """

    RESERVE = 1 << 16  # bytes per file

    def __init__(self, logs: Path, rank: str) -> None:
        self.paths = (logs / f"rank{rank}.log", logs / f"rank{rank}.error")
        self.fds: list[int] = []
        try:
            ensure_folder(logs)
            for path in self.paths:
                fd = open_in_place(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
                self.fds.append(fd)
                _reserve(fd, self.RESERVE)
        except (OSError, ConfigError):
            pass  # written where it can be, at the failure; a link there is never written through

    def write(self, traceback_text: str, line: str) -> None:
        # The log ends with the line too: what the terminal said (e.g. the full disk's path) stands
        # beside the traceback it summarizes.
        for i, text in enumerate((f"{traceback_text}\n{line}\n", f"{time.time()} {line}\n")):
            data = text.encode(errors="replace")
            try:
                if i < len(self.fds):
                    try:
                        os.pwrite(self.fds[i], data, 0)
                    except OSError:  # longer than the space reserved, on a full disk
                        data = data[: self.RESERVE]
                        os.pwrite(self.fds[i], data, 0)
                    os.ftruncate(self.fds[i], len(data))
                else:
                    write_atomic(ensure_folder(self.paths[i].parent) / self.paths[i].name, data, durable=False)
            except (OSError, ConfigError):
                pass

    def remove(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        try:
            self.paths[0].parent.rmdir()  # only when empty: other ranks' or earlier runs' logs stay
        except OSError:
            pass


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of disk for ``fd`` without changing its length (Linux fallocate, FALLOC_FL_KEEP_SIZE)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate(fd, 1, ctypes.c_int64(0), ctypes.c_int64(size))
    except (OSError, AttributeError):
        pass


def _linked_exceptions(e: BaseException) -> list[BaseException]:
    """``e`` and every exception linked to it: raised from or while handling (``from None``
    included), and the per-rank failures a torch CheckpointException carries."""
    from agoq.train.checkpoint import dcp_failures

    seen: dict[int, BaseException] = {}
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen[id(x)] = x
        todo += [x.__cause__, x.__context__]
        todo += [inner for _, inner in dcp_failures(x)]
    return list(seen.values())


def _disk_full(e: BaseException) -> OSError | None:
    """The ENOSPC error behind ``e``: one of :func:`_linked_exceptions`, or one only its message quotes."""
    import errno

    linked = _linked_exceptions(e)
    for x in linked:  # the error itself first: it names the file
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return x
    for x in linked:
        if f"[Errno {errno.ENOSPC}]" in str(x) or os.strerror(errno.ENOSPC) in str(x):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def _full_traceback(e: BaseException) -> str:
    """``e``'s traceback with what ``raise ... from None`` hid shown: an error made one clean line
    for the terminal (a CheckpointError) keeps its cause, such as an ENOSPC, in the rank's log."""
    import traceback

    for x in _linked_exceptions(e):
        x.__suppress_context__ = False
    return "".join(traceback.format_exception(e))


def _full_folder(cfg: TrainConfig) -> str:
    """The first of the run's folders whose disk is full (out_dir when none is, or none can be asked)."""
    import tempfile

    for folder in (cfg.train.out_dir, cfg.data.cache_dir, tempfile.gettempdir()):
        try:
            if folder and os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize < (1 << 20):
                return str(folder)
        except OSError:
            continue
    return str(cfg.train.out_dir)


def error_line(e: BaseException, cfg: TrainConfig) -> str:
    """The one line a worker's failure is reported with."""
    if isinstance(e, KeyboardInterrupt):
        return f"interrupted (pid {os.getpid()})"
    full = _disk_full(e)
    if full is not None:
        where = full.filename or _full_folder(cfg)
        return f"no space left on device (ENOSPC) writing {where}; free space on that disk, or write the run elsewhere with --train.out_dir=PATH"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def worker_entry(
    cfg: TrainConfig, choices: ResolvedChoices | None = None, launcher_pid: int | None = None, output: LauncherOutput | None = None
) -> dict[str, Any] | None:
    """What the local launcher runs in each worker: train_worker, with any error logged instead of printed.

    ``output``: the launcher's standard output and error, where this worker writes its lines.

    The worker dies with its launcher (``launcher_pid``) and holds a share of the run folder's lock
    for as long as it lives. The full traceback of a failure goes to ``out_dir/logs/rank<R>.log``
    and its line to ``rank<R>.error``; the worker then exits with status 1 (130 for Ctrl-C)
    without printing a traceback, and the launcher prints one line (:func:`failure_line`).
    """
    import signal

    if output is not None:
        output.install()
    if launcher_pid is not None:
        die_with_launcher(launcher_pid)
        unnamed_locks()
    # Until the process group is up, a Ctrl-C ends the worker at once: joining it waits in C++ on the
    # store (where no Python handler runs) for peers that, interrupted too, never come, until the
    # launcher kills every worker after its close timeout. From then on a Ctrl-C is raised and logged.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    rank = os.environ.get("RANK", "0")
    log = _RankLog(Path(cfg.train.out_dir) / "logs", rank)
    _DeferredInterrupt.install()
    try:
        if launcher_pid is not None:
            join_run_lock(cfg.train.out_dir)
        native = _NativeStderrToLog(Path(cfg.train.out_dir) / "logs" / f"rank{rank}.join.log")

        def group_ready() -> None:
            native.restore()
            signal.signal(signal.SIGINT, signal.default_int_handler)

        result = train_worker(cfg, choices, group_ready=group_ready)
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        # The launcher signals its workers again while they exit (with the signal it got: SIGINT
        # after a Ctrl-C); an interrupt inside Python's exit handlers would print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if interrupted:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.write(_full_traceback(e), error_line(e, cfg))
        if interrupted:
            sys.stderr.flush()
            os._exit(130)  # skip exit handlers: nothing of this run needs them, and they can be interrupted again
        raise SystemExit(1) from None
    log.remove()
    return result


def failure_line(out_dir: str | os.PathLike[str], failures: dict[int, Any], world_size: int | None = None) -> str:
    """One line for a run whose workers failed: the first failure (by time) in the logs of the
    run's ``world_size`` ranks, and where its traceback is.

    torch's launcher reports one failed rank, the first it finds exited (``failures``: rank ->
    ProcessFailure, with ``exitcode`` and ``pid``), not the first that failed; it names a rank
    that died without writing a log (killed by a signal).
    """
    import re
    import signal

    logs = Path(out_dir) / "logs"
    found = []
    for rank in sorted(set(failures) | set(range(world_size or 0))):
        try:
            stamp, _, line = (logs / f"rank{rank}.error").read_text().strip().partition(" ")
            found.append((float(stamp), rank, line))
        except (OSError, ValueError):
            continue
    # A rank killed by a signal before the launcher stopped anyone is the cause: the others' errors
    # (gloo's "Connection reset by peer") follow from its death, and may be written before the
    # launcher notices it.
    logged = {rank for _, rank, _ in found}
    killed = [(rank, f) for rank, f in sorted(failures.items()) if getattr(f, "exitcode", 0) < 0 and rank not in logged]
    if killed:
        rank, f = killed[0]
        if f.exitcode == -signal.SIGINT:  # while joining the process group (worker_entry)
            return f"rank {rank} (pid {f.pid}) was interrupted (SIGINT), and the run stopped with it"
        try:
            name = signal.Signals(-f.exitcode).name
        except ValueError:
            name = f"signal {-f.exitcode}"
        return f"rank {rank} (pid {f.pid}) was killed by {name} without a Python error (by another process, or the out-of-memory killer)"
    if not found:
        return f"a worker process died without a Python error (killed, or out of memory); ranks {sorted(failures)} failed"
    # Other ranks fail after the first one, on the collectives it no longer answers. A full disk is
    # the cause wherever it shows: a rank whose checkpoint collective failed on a peer's ENOSPC can
    # log its own error, without the ENOSPC, before the peer whose write failed.
    full_disk = [f for f in found if f[2].startswith("no space left on device")]
    _, rank, line = min(full_disk or found)
    interrupted = re.fullmatch(r"interrupted \(pid (\d+)\)", line)
    if interrupted:
        return f"rank {rank} (pid {interrupted.group(1)}) was interrupted (SIGINT), and the run stopped with it"
    return f"rank {rank} failed: {line} (full traceback: {logs / f'rank{rank}.log'})"


def resolve_auto_choices(cfg: TrainConfig) -> ResolvedChoices:
    """The compute dtype and quantization backend of a local run, decided by the launcher for its
    workers (agoq.launch.choices.resolve_choices), each ``auto`` printed with which and why."""
    from agoq.launch.choices import resolve_choices

    choices = resolve_choices(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    _say_choices(choices)
    return choices


def _say_choices(choices: ResolvedChoices) -> None:
    """The opening lines of the run's decided ``auto`` values (agoq.launch.choices returns them, the launch prints)."""
    for line in choices.lines:
        print(line, flush=True)


def launch(cfg: TrainConfig, max_restarts: int = 0) -> dict[str, Any] | None:
    """Run the training: in place under torchrun, else spawn pp x dp x tp local processes with torch's launcher."""
    first = not under_torchrun() or os.environ.get("RANK", "0") == "0"
    check_run_folder(cfg.train.out_dir)
    done = finished_run(cfg)
    if done is not None:
        return report_finished(cfg, done) if first else None
    if under_torchrun():
        raise_deferred_interrupt()  # this process trains: a Ctrl-C raises where it lands from here
        if not first:
            return train_worker(cfg)
        with run_lock(cfg.train.out_dir):  # rank 0 holds the folder for the job
            announce(cfg, f"{os.environ.get('WORLD_SIZE', '?')} processes under torchrun")
            return train_worker(cfg)
    # Build the tokenizer and token file once, here: a bad corpus, or one other than a resumed
    # checkpoint's, is refused before the run folder is touched, and the workers only read the cache.
    # A folder in use is refused before that work, and claimed after it.
    from agoq.data.tokens import prepare_data
    from agoq.launch.lock import check_not_in_use

    check_not_in_use(cfg.train.out_dir)

    d = cfg.data
    data = prepare_data(d.corpus if d.corpus != "kjv" else None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction)
    check_data(cfg, len(data.train), len(data.val), data.tokenizer.vocab_size)
    check_resume_data(cfg, data)
    with run_lock(cfg.train.out_dir):
        return _launch_local(cfg, max_restarts)


# What a run writes in its folder: these files, and anything in these folders.
RUN_FILES = (LOCK_NAME, "summary.json", "summary.md", "loss.png")
RUN_FOLDERS = ("logs", "metrics", "checkpoints")


def check_run_folder(out_dir: str | os.PathLike[str]) -> None:
    """ConfigError (one line naming it and the fix) for a link among what a run writes in ``out_dir``.

    Checked before anything is written; the writes themselves never follow a link either
    (agoq.nofollow), so one made after this check is replaced or refused, never written through.
    """
    out = Path(out_dir)
    for name in RUN_FILES + RUN_FOLDERS:
        refuse_link(out / name, in_place=name == LOCK_NAME)
    for name in RUN_FOLDERS:
        try:
            entries = sorted(os.scandir(out / name), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            # Logs and metrics are written in place: a hard link would change its other name's file too.
            refuse_link(entry.path, in_place=name != "checkpoints")


def check_resume_data(cfg: TrainConfig, data: Any, notice: bool = True) -> None:
    """ConfigError when the checkpoint a run resumes was trained on another corpus or tokenizer than
    ``data`` (agoq.data.tokens.TokenData); one line of ``notice`` when the checkpoint does not say."""
    from agoq.train.checkpoint import CheckpointError, latest_checkpoint, trained_on

    if not cfg.checkpoint.resume:
        return
    try:
        latest = latest_checkpoint(checkpoint_root(cfg), trust_unverified=cfg.checkpoint.trust_unverified)
    except CheckpointError:
        return  # refused by finished_run, with its own line
    if latest is None:
        return
    saved, here = trained_on(latest), data.fingerprints()
    if saved is None:
        if not notice:
            return
        print(
            f"agoq train: checkpoint {latest} records no tokenizer or corpus fingerprint (saved by an earlier agoq, or without its manifest): "
            "the tokenizer and corpus of this run cannot be verified against the ones it was trained on",
            flush=True,
        )
        return
    d = cfg.data
    tokenizer = f"data.tokenizer={d.tokenizer!r}" if d.tokenizer else f"the tokenizer (a BPE of data.vocab_size={d.vocab_size} trained on the corpus)"
    source = "tokenizer file" if d.tokenizer else "data.vocab_size"
    checks = (
        ("corpus_fingerprint", f"data.corpus={d.corpus!r} is not the corpus checkpoint {latest} was trained on", "fingerprint", "corpus"),
        (
            "tokenizer_fingerprint",
            f"{tokenizer} is not the tokenizer checkpoint {latest} was trained with",
            "vocabulary fingerprint",
            source,
        ),
        # The same corpus and vocabulary giving other ids: the normalizer, the pre-tokenizer or the
        # end-of-document token changed.
        (
            "tokens_sha256",
            f"{tokenizer} splits the corpus into other tokens than checkpoint {latest} was trained on",
            "token file SHA-256",
            source,
        ),
    )
    for key, what, digest, original in checks:
        if key in saved and saved[key] != here[key]:
            raise ConfigError(
                f"{what} ({digest} {here[key][:12]} here, {str(saved[key])[:12]} in the checkpoint); "
                f"resume with the original {original}, or start a new run with --train.out_dir=runs/NAME"
            )


def _launch_local(cfg: TrainConfig, max_restarts: int) -> dict[str, Any] | None:
    """Spawn pp x dp x tp local worker processes with torch's elastic launcher and return rank 0's summary."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    choices = resolve_auto_choices(cfg)
    announce(cfg, f"{cfg.world_size} local process{'es' if cfg.world_size > 1 else ''}", choices)
    # Nothing of a local run listens beyond this machine (agoq.launch.loopback): the rendezvous store
    # is hosted here on 127.0.0.1, rank 0's store likewise, and gloo connects over loopback.
    from agoq.launch.loopback import loopback_store

    rdzv_store, rdzv_port = loopback_store()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=f"agoq-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{rdzv_port}",
        rdzv_configs={"is_host": False},  # connect to the store above instead of hosting one on every interface
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        start_method="spawn",  # decided below, once the workers' environment is set
        monitor_interval=0.1,  # how soon a finished or failed worker is noticed (torchrun's default)
    )
    raise_deferred_interrupt()  # one pressed while torch was imported or the data prepared
    # Earlier failures' logs would be mistaken for this run's.
    for stale in (Path(cfg.train.out_dir) / "logs").glob("rank*.error"):
        stale.unlink(missing_ok=True)
    try:
        with workers_environment():  # the workers inherit it; this process gets its own back after
            config.start_method = start_method()
            results = elastic_launch(config, worker_entry)(cfg, choices, os.getpid(), LauncherOutput())
    finally:
        del rdzv_store  # closes its socket
    return results.get(0)
