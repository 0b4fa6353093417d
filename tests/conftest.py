"""Session-wide test setup."""

import atexit
import os
import shutil
import tempfile

from agoq.inductor_cache import use_layout_cache_tag

# As agoq's launcher does, before torch is imported: graphs compiled by an earlier revision of
# agoq's ops (inductor's cache outlives a checkout) are not handed to this one.
use_layout_cache_tag()

# Inductor builds each graph's kernels in the process that compiles it instead of a pool of compile
# workers (read when inductor's config is imported): on a 2-core test machine every process that
# compiles (each test process, each compiling run) would start a pool whose workers import torch,
# which costs more than the pool overlaps.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from agoq.launch.choices import worker_threads  # noqa: E402

from tests._data import ENV_VAR as DATA_CACHE_ENV  # noqa: E402

# Each test process gets its share of the cores, as a local run gives each of its workers: with
# torch's default, the two test processes of `pytest -n 2` on 2 cores ran four compute threads, and
# every multi-threaded op waited at its barrier for a thread that was descheduled.
torch.set_num_threads(worker_threads(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Without a GPU the Triton kernels run under Triton's interpreter, which must be chosen before
# anything imports triton (torch.compile in the 8-bit AdamW tests does): kernels bind to the
# interpreter when they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite checks the torch reference path; tests/test_compiled.py checks that the compiled CPU
# path (the default of `agoq train` on CPUs for runs that repay compiling, agoq.launch.choices) gives the same codes, scales,
# folds and sums.
# Compiling every format in every spawned worker would cost minutes of the suite's time.
os.environ.setdefault("AGOQ_QUANT_BACKEND", "torch")

# One tokenizer and token cache for the suite's training runs (tests/_data.py).
if DATA_CACHE_ENV not in os.environ:
    os.environ[DATA_CACHE_ENV] = tempfile.mkdtemp(prefix="agoq_test_data_")
    atexit.register(shutil.rmtree, os.environ[DATA_CACHE_ENV], ignore_errors=True)

# The files that take longest (their whole runs and process groups; pytest --durations), handed to
# the two test processes first. pytest-xdist otherwise hands out the files with the most tests
# first, which leaves these few-but-long ones for last, and one process then runs them alone while
# the other idles. Only the order changes; every file still runs whole in one process.
LONGEST_FIRST = (
    "test_faults_launcher.py",
    "test_faults_checkpoint.py",
    "test_compile_native.py",
    "test_plan_train.py",
    "test_faults.py",
    "test_train_tp.py",
    "test_fsdp_exact.py",
    "test_benchmarks.py",
    "test_parity.py",
    "test_elastic.py",
    "test_zero1.py",
    "test_triton.py",
    "test_train.py",
    "test_lora.py",
    "test_train_hier.py",
    "test_gradient_error_feedback.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's scheduler is in use
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file stays whole and in order
