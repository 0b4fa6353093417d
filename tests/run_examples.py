"""Run one example's ``main(argv)`` several times in the same processes, one argument list after
each ``--``: ``torchrun --nproc-per-node=2 tests/run_examples.py examples/X.py -- ARGS -- ARGS``.

The tests compare an example's runs (with and without agoq, one Trainer and another); each process
imports torch, transformers and the example once instead of once per run.
"""

from __future__ import annotations

import importlib.util
import sys

import torch.distributed as dist


def main() -> None:
    path, *rest = sys.argv[1:]
    runs, current = [], None
    for arg in rest:
        if arg == "--":
            current = []
            runs.append(current)
        else:
            current.append(arg)
    spec = importlib.util.spec_from_file_location("example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for argv in runs:
        example.main(argv)
    # Every rank leaves the process group together (an exit with gloo's threads running can abort a rank).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
