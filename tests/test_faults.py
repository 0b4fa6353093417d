"""Faults a user can cause, and what agoq does about each: refuse with one line, or carry on safely."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from agoq.launch.lock import LOCK_NAME, FolderInUse, run_lock
from tests._data import SMALL_MODEL, data_args, data_cache

HOLD = "import sys, time; from agoq.launch.lock import run_lock\nwith run_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n"


def _holder(folder) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_folder_in_use_stops_at_once_naming_the_holder(tmp_path, capsys, monkeypatch):
    import agoq.data.tokens
    import agoq.launch.run
    from agoq.cli import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("the folder in use must be refused before any data preparation or process launch")

    # Asserted by what runs, not by a clock: a busy machine's imports alone can take seconds.
    monkeypatch.setattr(agoq.data.tokens, "prepare_data", must_not_run)
    monkeypatch.setattr(agoq.launch.run, "_launch_local", must_not_run)
    proc = _holder(tmp_path)
    try:
        with pytest.raises(FolderInUse, match=f"is in use by another agoq run \\(pid {proc.pid} on "):
            with run_lock(tmp_path):
                pass
        assert main(["train", f"--train.out_dir={tmp_path}", "--train.steps=1"]) == 2
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
        ("--parallel.zero1=true --parallel.dp=1", "parallel.zero1=true shards optimizer state over the dp ranks, but parallel.dp=1"),
        ("--train.seed=-1", "agoq train: train.seed=-1 is out of range; use an integer from 0 to 4294967295 (2**32 - 1)"),
        (
            "--train.seed=99999999999999999999999",
            "agoq train: train.seed=99999999999999999999999 is out of range; use an integer from 0 to 4294967295 (2**32 - 1)",
        ),
        ("--model.tie_embeddings=maybe", "agoq train: model.tie_embeddings='maybe' is not a boolean; use true or false (or yes/no, 1/0)"),
        ("--parallel.node_size=3 --parallel.dp=4", "agoq train: parallel.node_size=3 must divide parallel.dp=4"),
    ],
)
def test_every_bad_value_is_refused_before_launch_with_one_line(override, message, capsys):
    from agoq.cli import main

    assert main(["train", *override.split()]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_largest_seed_is_accepted_and_reaches_every_generator():
    import numpy as np

    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from agoq.launch.config import MAX_SEED, load_config

    assert load_config(None, [f"--train.seed={MAX_SEED}"]).train.seed == MAX_SEED
    torch.manual_seed(MAX_SEED)
    np.random.default_rng([MAX_SEED, 0])
    Llama(LlamaConfig(vocab_size=64, hidden=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=64)).reset_parameters(MAX_SEED)


def test_a_config_file_with_a_byte_order_mark_reads_as_without(tmp_path, capsys):
    from agoq.cli import main
    from agoq.launch.config import load_config

    text = '[train]\nsteps = 7\nseed = 3\n\n[model]\npreset = "tiny"\n'
    plain, marked = tmp_path / "plain.toml", tmp_path / "bom.toml"
    plain.write_text(text, encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(marked).to_dict() == load_config(plain).to_dict()
    assert load_config(marked).train.steps == 7
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[train]\nout_dir = "runs/caf\xe9"\n'.encode("latin-1"))
    assert main(["train", str(latin)]) == 2
    assert capsys.readouterr().err == f"agoq train: config file {latin} is not UTF-8 text (byte offset 27); save it as UTF-8\n"


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
    args = [f"--data.corpus={tiny}", f"--data.cache_dir={data_cache()}", f"--train.out_dir={tmp_path / 'run'}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "fewer than one batch of data.batch_size=16 x (data.seq_len=128 + 1) = 2064" in err and err.count("\n") == 1, err
    blocked = tmp_path / "file"
    blocked.write_text("a file where the run folder should be")
    assert main(["train", f"--train.out_dir={blocked / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"train.out_dir='{blocked / 'run'}' cannot be written" in err and err.count("\n") == 1, err


# ---------------------------------------------------------------------------------- checkpoints


def _saved(tmp_path):
    import torch

    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from agoq.train.checkpoint import capture_rng_state, save_checkpoint

    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16)
    model = Llama(cfg)
    model.reset_parameters(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 16))
    model(x, x).backward()
    opt.step()
    step_dir = save_checkpoint(tmp_path / "ck", 7, model, opt, {"rng": capture_rng_state(), "sampler": {"index": 3}})
    fresh = Llama(cfg)
    fresh.reset_parameters(1)
    return step_dir, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)


def _refused(step_dir, model, opt, monkeypatch) -> str:
    """Load, expecting a one-line refusal before DCP unpickles the index or any tensor reaches the model."""
    import torch
    import torch.distributed.checkpoint as dcp

    from agoq.train.checkpoint import CheckpointError, load_checkpoint

    def no_unpickling(self):
        raise AssertionError("the index was unpickled before the files were verified")

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", no_unpickling)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(step_dir, model, opt)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    monkeypatch.undo()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def _flip(path, offset=None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_bit_flip_in_a_shard_is_refused_naming_the_file_and_step(tmp_path, monkeypatch):
    step_dir, model, opt = _saved(tmp_path)
    _flip(step_dir / "__0_0.distcp")
    msg = _refused(step_dir, model, opt, monkeypatch)
    assert f"{step_dir / '__0_0.distcp'} of step 7 is damaged" in msg and "SHA-256" in msg and "delete" in msg


def test_a_bit_flip_in_the_index_is_refused_before_it_is_unpickled(tmp_path, monkeypatch):
    step_dir, model, opt = _saved(tmp_path)
    _flip(step_dir / ".metadata")
    msg = _refused(step_dir, model, opt, monkeypatch)
    assert f"{step_dir / '.metadata'} of step 7 is damaged" in msg


def test_a_deleted_or_truncated_shard_is_refused(tmp_path, monkeypatch):
    step_dir, model, opt = _saved(tmp_path)
    shard = step_dir / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1])
    assert "truncated or altered" in _refused(step_dir, model, opt, monkeypatch)
    shard.unlink()
    assert "is missing __0_0.distcp" in _refused(step_dir, model, opt, monkeypatch)


class _Payload:
    """Unpickling this creates a file: the stand-in for code a crafted checkpoint would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_pickle_in_the_trainer_state_runs_nothing(tmp_path, monkeypatch):
    import torch

    from agoq.models.config import LlamaConfig
    from agoq.models.llama import Llama
    from agoq.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, max_seq_len=16)
    model = Llama(cfg)
    sentinel = tmp_path / "code_ran"
    # The save refuses such state itself ...
    with pytest.raises(CheckpointError, match="cannot be stored as tensors and plain values"):
        save_checkpoint(tmp_path / "ck", 1, model, None, {"evil": _Payload(str(sentinel))})
    assert not sentinel.exists()
    # ... so write one the way an attacker would, with a correct manifest, and load it.
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: None)
    step_dir = save_checkpoint(tmp_path / "ck", 1, model, None, {"evil": _Payload(str(sentinel))})
    monkeypatch.setattr(torch, "load", real_load)
    with pytest.raises(CheckpointError, match="holds more than tensors and plain values"):
        load_checkpoint(step_dir, Llama(cfg), None)
    assert not sentinel.exists()


def test_the_trainer_state_round_trips_without_pickle(tmp_path):
    import random

    import numpy as np
    import torch

    from agoq.train.checkpoint import load_checkpoint, restore_rng_state

    step_dir, model, opt = _saved(tmp_path)
    step, extra = load_checkpoint(step_dir, model, opt)
    assert step == 7 and extra["sampler"] == {"index": 3}
    # Restoring the saved generators twice draws the same numbers twice: torch, Python and NumPy.
    restore_rng_state(extra["rng"])
    first = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_state(extra["rng"])
    assert torch.equal(torch.rand(3), first[0]) and random.random() == first[1] and np.random.rand() == first[2]


# ---------------------------------------------------------------------------------- whole runs

SMALL = [
    *SMALL_MODEL,
    "--data.batch_size=8",
    "--parallel.microbatches=2",
    "--optim.warmup_steps=0",
    "--train.eval_every=0",
    "--train.baseline=false",
    "--precision.compute_dtype=fp32",
]


def test_metrics_rows_of_redone_steps_are_dropped_on_resume(tmp_path):
    import json

    from agoq.train.metrics import JsonlWriter

    w = JsonlWriter(tmp_path / "rank0.jsonl")
    for step in (1, 2, 3, 4, 5):  # a run saved at step 2, then crashed after step 5
        w.write({"step": step})
    w.keep_until(2)
    w.write({"step": 3})
    w.close()
    assert [json.loads(l)["step"] for l in (tmp_path / "rank0.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_diverging_run_stops_with_one_line_and_keeps_its_good_checkpoints(tmp_path, capsys):
    from agoq.cli import main
    from agoq.train.checkpoint import latest_checkpoint

    out = tmp_path / "run"
    args = SMALL + [
        *data_args(),
        f"--train.out_dir={out}",
        "--train.steps=8",
        "--optim.lr=1e30",
        "--optim.min_lr=1e30",
        "--optim.grad_clip=0",
        "--train.max_skipped_steps=2",
        "--checkpoint.every=1",
        "--checkpoint.keep=2",
    ]
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("agoq train:")]
    assert len(lines) == 1 and "TrainingDiverged" in lines[0] and "non-finite for 2 steps in a row" in lines[0], err
    assert "Traceback" not in err
    assert "Traceback" in (out / "logs" / lines[0].split("logs/")[1].rstrip(")")).read_text()
    # Only good steps were saved: the newest checkpoint's weights are finite.
    import json

    newest = latest_checkpoint(out / "checkpoints")
    records = [json.loads(l) for l in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    good = [r["step"] for r in records if not r["skipped"] and r["loss"] == r["loss"] and abs(r["loss"]) != float("inf")]
    assert newest is not None and int(newest.name.split("_")[1]) <= max(good)


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    out = tmp_path / "run"
    # Eager quantization: a 100000-step run would otherwise compile, and inductor's compile workers
    # share the process group (a Ctrl-C in the middle of a compile is not what this checks).
    args = SMALL + [
        *data_args(),
        f"--train.out_dir={out}",
        "--train.steps=100000",
        "--checkpoint.every=0",
        "--precision.quant_backend=torch",
        "--parallel.pp=1",  # two workers (dp=2): a Ctrl-C reaches one peer as it does three
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agoq", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    metrics = out / "metrics" / "rank0.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.5)
    assert metrics.exists(), "the run did not start"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "agoq train: interrupted" in err, err


def test_a_ctrl_c_inside_a_weakref_callback_is_raised_between_steps_not_printed(capfd):
    # The step's allocation meter frees through weakref callbacks; a Ctrl-C landing in one printed
    # "Exception ignored in ..." with a traceback and was lost. The worker keeps it for the step's end.
    import weakref

    import torch

    from agoq.launch.run import _DeferredInterrupt

    def interrupt(_ref):
        raise KeyboardInterrupt

    saved_hook = sys.unraisablehook
    try:
        _DeferredInterrupt.install()
        t = torch.ones(4)
        ref = weakref.ref(t.untyped_storage(), interrupt)
        del t
        assert ref() is None and _DeferredInterrupt.pending
        with pytest.raises(KeyboardInterrupt):
            _DeferredInterrupt.raise_pending()
        assert not _DeferredInterrupt.pending
        _DeferredInterrupt.raise_pending()  # raised once only
    finally:
        sys.unraisablehook = saved_hook
        _DeferredInterrupt.pending = False
    assert "Traceback" not in capfd.readouterr().err


def _listening() -> set[tuple[str, str, str]]:
    """(local address, port, socket inode) of every TCP socket listening on this machine, hex as /proc/net/tcp* writes them."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found.add((*fields[1].split(":"), fields[9]))
    return found


def _own_socket_inodes() -> set[str]:
    """Inodes of the sockets that this process and its descendants (the run's launcher, fork server
    and workers) hold: another test running beside this one may listen anywhere it likes."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grown = {os.getpid()}, True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grown = bool(children)
    inodes = set()
    for pid in tree:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    return inodes


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_a_local_run_listens_on_loopback_only(tmp_path, capsys):
    import threading

    from agoq.cli import main

    before = _listening()
    seen: set[tuple[str, str]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            new = _listening() - before
            if new:
                own = _own_socket_inodes()
                seen.update((addr, port) for addr, port, inode in new if inode in own)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # Two workers (dp=2): the launcher's store and gloo's pairs between ranks listen as with more.
        args = SMALL + [*data_args(), f"--train.out_dir={tmp_path / 'run'}", "--train.steps=2", "--checkpoint.every=0", "--parallel.pp=1"]
        assert main(["train", *args]) == 0
    finally:
        done.set()
        watcher.join()
    capsys.readouterr()
    assert seen, "no listening socket was seen during the run"
    assert all(addr in LOOPBACK for addr, _ in seen), sorted(seen)


def test_a_resumed_run_says_which_checkpoint_it_continues_from(tmp_path, capfd):
    from agoq.cli import main

    # One process with eager quantization: what is checked is the message, not the layout.
    args = SMALL + [
        *data_args(),
        f"--train.out_dir={tmp_path / 'run'}",
        "--checkpoint.every=2",
        "--parallel.pp=1",
        "--parallel.dp=1",
        "--precision.quant_backend=torch",
    ]
    assert main(["train", *args, "--train.steps=2"]) == 0
    capfd.readouterr()
    assert main(["train", *args, "--train.steps=3"]) == 0
    out = capfd.readouterr().out  # printed by rank 0, a worker process
    assert f"agoq train: resuming from {tmp_path / 'run' / 'checkpoints' / 'step_000002'} (step 2 of 3;" in out, out[-3000:]
