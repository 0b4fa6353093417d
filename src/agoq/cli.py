"""The ``agoq`` command line: train and plan."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import agoq

if TYPE_CHECKING:
    from agoq.launch.config import TrainConfig


TRAIN_HELP = "train a LLaMA model (default: tiny model on the KJV Bible, 4 local processes, pp=2 x dp=2)"
PLAN_HELP = "memory per pipeline rank of a real configuration, bf16 baseline vs AGoQ"
# The benchmarks are not part of the installed package: they live in the repository's benchmarks/.
BENCH_MOVED = (
    "agoq bench: the benchmarks moved out of the agoq package; from a checkout of the repository run "
    "`python -m benchmarks.NAME [args]` (`python -m benchmarks` lists them)"
)


def build_parser(command: str | None = None, config_fields: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``agoq`` command, with the options of ``command`` (None: every command).

    Only the command being run gets its options, so that ``agoq --help`` and ``agoq plan --help``
    do not import torch. ``config_fields``: list the config's fields under ``agoq train --help``,
    which imports torch (for the quantization backends' names); a launch, which must start its
    fork server before torch is imported, parses without them.
    """
    parser = argparse.ArgumentParser(
        prog="agoq",
        description="Train LLaMA-style models with 4-bit saved activations and 8-bit gradients (AGoQ).",
    )
    parser.add_argument("--version", action="version", version=f"agoq {agoq.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    every = command is None
    if every or command == "train":
        from agoq.launch.config import config_help

        train = sub.add_parser(
            "train",
            help=TRAIN_HELP,
            description="Train a LLaMA model with AGoQ. With no arguments: the embedded default run. "
            "Override any config value with --section.key=value, e.g. --train.steps=50 --parallel.pp=1.",
            epilog=config_help() if config_fields else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        train.add_argument("config", nargs="?", help="a TOML config file (see configs/)")
        train.add_argument("--max-restarts", type=int, default=0, help="restart the local workers this many times after a failure")
        train.add_argument(
            "--print-config", action="store_true", help="print the effective configuration as TOML (file and overrides applied) and exit"
        )
    else:
        sub.add_parser("train", help=TRAIN_HELP)
    if every or command == "plan":
        from agoq.plan.cli import DESCRIPTION as PLAN_DESCRIPTION, add_arguments as plan_arguments

        plan = sub.add_parser("plan", help=PLAN_HELP, description=PLAN_DESCRIPTION)
        plan_arguments(plan)
    else:
        sub.add_parser("plan", help=PLAN_HELP)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv (the first argument that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``agoq`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    if command == "bench":
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    parser = build_parser(command if command in ("train", "plan") else "", config_fields=bool({"-h", "--help"} & set(argv)))
    # Config overrides (--section.key=value) go straight to the config loader: argparse would take
    # one whose value holds a space ("--model.overrides={n_layers = 4}") for the config file.
    overrides = [a for a in argv if a.startswith("--") and "." in a.split("=", 1)[0]] if argv[:1] == ["train"] else []
    args, extra = parser.parse_known_args([a for a in argv if a not in overrides])
    if args.command == "train":
        return _train(args, overrides + extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "plan":
        from agoq.plan.cli import run as plan_run

        return plan_run(args)
    parser.print_help()
    return 0


def _load_config_and_start_fork_server(args: argparse.Namespace, overrides: list[str]) -> TrainConfig:
    """load_config in its two steps, with the local run's fork server started between them: after
    the read, which it chooses its imports from, before the validation, which imports torch, so
    that the server's imports overlap the launcher's own (agoq.launch.forkserver)."""
    from agoq.inductor_cache import use_capability_cache, use_layout_cache_tag
    from agoq.launch.config import read_config, validate
    from agoq.launch.forkserver import start_early, worker_preload

    cfg = read_config(args.config, overrides)
    if not args.print_config:
        use_capability_cache()  # before torch is imported: the workers inherit the folder (agoq.inductor_cache)
        use_layout_cache_tag()
        start_early(worker_preload(cfg))
    validate(cfg)
    return cfg


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from agoq.launch.config import ConfigError

    try:
        cfg = _load_config_and_start_fork_server(args, overrides)
    except ConfigError as e:
        print(f"agoq train: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from agoq.launch.config import to_toml

        print(to_toml(cfg), end="")
        return 0
    from agoq.launch.environment import environment_problem

    problem = environment_problem()
    if problem is not None:
        print(f"agoq train: {problem}", file=sys.stderr)
        return 2
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from agoq.launch.planning import check_memory
    from agoq.launch.forkserver import under_torchrun
    from agoq.launch.lock import FolderInUse
    from agoq.launch.run import checkpoint_root, failure_line, launch

    import torch.distributed.launcher.api  # noqa: F401  (its loggers must exist to be quieted)

    # torch's launcher logs each worker's exit at WARNING/ERROR; agoq prints one line instead.
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        if not under_torchrun():
            check_memory(cfg)  # a local run's processes share this machine's memory
        launch(cfg, max_restarts=args.max_restarts)
    except (FolderInUse, ConfigError) as e:  # found before any worker started
        print(f"agoq train: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SignalException):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while shutting down prints no traceback
        print(
            f"agoq train: interrupted; checkpoints already written in {checkpoint_root(cfg)} are intact, "
            "and running the same command resumes from the newest",
            file=sys.stderr,
        )
        return 130
    except ChildFailedError as e:
        line = failure_line(cfg.train.out_dir, e.failures, cfg.world_size)
        print(f"agoq train: {line}", file=sys.stderr)
        return 130 if " was interrupted " in line else 1
    except OSError as e:  # the launcher's own writes: the data cache, the run folder
        print(f"agoq train: {_os_error_line(e)}", file=sys.stderr)
        return 1
    return 0


def _os_error_line(e: OSError) -> str:
    import errno

    where = f" writing {e.filename}" if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on device (ENOSPC){where}; free space on that disk, or write elsewhere (--train.out_dir=PATH, --data.cache_dir=PATH)"
    return f"{e.strerror or e}{where}"


INTERRUPTED = "agoq train: interrupted before training started"


def console_main() -> None:
    """The ``agoq`` console script and ``python -m agoq``: :func:`main`, and its exit status.

    A Ctrl-C before the training's own handling is in place (while torch is imported, or the data
    prepared) ends the command with one line and status 130, as one during training does. An
    interrupted command leaves without the interpreter's exit: a Ctrl-C that landed in code an
    extension ran (PyRun_String) makes the interpreter kill itself with SIGINT at exit whatever the
    status, and its exit handlers wait for threads the interrupt may have left stuck.
    """
    import signal

    from agoq.launch.forkserver import defer_interrupts, raise_deferred_interrupt

    defer_interrupts()  # the launch raises a Ctrl-C noted until then (agoq.launch.run._launch_local)
    try:
        code = main()
        raise_deferred_interrupt()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting prints nothing either
        print(INTERRUPTED, file=sys.stderr)
        code = 130
    if code == 130:
        import gc
        import os

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # os._exit runs no exit handlers: a multiprocessing lock of the launch (torch's elastic agent
        # makes one per worker) that a reference cycle still holds would stay registered with the
        # resource tracker, which then warns of a leaked semaphore; collecting runs its finalizer.
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
