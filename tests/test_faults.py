"""Faults a user can cause, and what agoq does about each: refuse with one line, or carry on safely."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agoq.train.lock import LOCK_NAME, FolderInUse, run_lock

HOLD = "import sys, time; from agoq.train.lock import run_lock\nwith run_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n"


def _holder(folder) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_folder_in_use_stops_at_once_naming_the_holder(tmp_path, capsys):
    from agoq.cli import main

    proc = _holder(tmp_path)
    try:
        with pytest.raises(FolderInUse, match=f"is in use by another agoq run \\(pid {proc.pid} on "):
            with run_lock(tmp_path):
                pass
        t0 = time.perf_counter()
        assert main(["train", f"--train.out_dir={tmp_path}", "--train.steps=1"]) == 2
        assert time.perf_counter() - t0 < 5  # before any data preparation or process launch
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pid {proc.pid}" in err and "--train.out_dir=" in err
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_killed_run_blocks_nothing(tmp_path):
    proc = _holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / LOCK_NAME).exists()  # the file stays; the kernel dropped the lock with the process
    with run_lock(tmp_path) as path:
        assert f"pid {os.getpid()} " in path.read_text()


@pytest.mark.parametrize(
    "override, message",
    [
        ("--optim.lr=inf", "optim.lr=inf must be a finite number"),
        ("--optim.lr=nan", "optim.lr=nan must be a finite number"),
        ("--optim.min_lr=nan", "optim.min_lr=nan must be a finite number"),
        ("--optim.beta1=1.5", "optim.beta1=1.5 must be in [0, 1)"),
        ("--optim.eps=-1e-8", "optim.eps=-1e-08 must be > 0"),
        ("--optim.weight_decay=nan", "optim.weight_decay=nan must be a finite number"),
        ("--optim.grad_clip=nan", "optim.grad_clip=nan must be a finite number"),
        ("--optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
        ("--data.batch_size=0", "data.batch_size=0 must be >= 1"),
        ("--data.batch_size=-8", "data.batch_size=-8 must be >= 1"),
        ("--train.eval_batches=0", "train.eval_batches=0 must be >= 1"),
        ("--train.eval_every=-1", "train.eval_every=-1 must be >= 0"),
        ("--train.log_every=0", "train.log_every=0 must be >= 1"),
        ("--train.out_dir=", "train.out_dir is empty"),
        ("--model.rope_theta=nan", "model.rope_theta=nan must be a finite number > 0"),
        ("--data.vocab_size=1", "data.vocab_size=1 must be at least 257"),
    ],
)
def test_every_bad_value_is_refused_before_launch_with_one_line(override, message, capsys):
    from agoq.cli import main

    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_tokenizer_file_that_does_not_parse_is_refused(tmp_path, capsys):
    from agoq.cli import main

    bad = tmp_path / "tokenizer.json"
    bad.write_text("this is not a tokenizer")
    assert main(["train", f"--data.tokenizer={bad}"]) == 2
    err = capsys.readouterr().err
    assert f"data.tokenizer='{bad}' is not a tokenizer file that loads" in err and err.count("\n") == 1, err


def test_a_corpus_shorter_than_one_batch_and_an_unwritable_out_dir_are_refused(tmp_path, capsys):
    from agoq.cli import main

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("In the beginning. " * 40)
    args = [f"--data.corpus={tiny}", f"--data.cache_dir={tmp_path / 'cache'}", f"--train.out_dir={tmp_path / 'run'}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "fewer than one batch of data.batch_size=16 x (data.seq_len=128 + 1) = 2064" in err and err.count("\n") == 1, err
    blocked = tmp_path / "file"
    blocked.write_text("a file where the run folder should be")
    assert main(["train", f"--train.out_dir={blocked / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"train.out_dir='{blocked / 'run'}' cannot be written" in err and err.count("\n") == 1, err
