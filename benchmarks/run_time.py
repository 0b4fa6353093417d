"""Wall time of whole `agoq train` commands as a user runs them: the embedded default as a user's
first run (nothing compiled, no tokenizer or token cache), also held to AVX2 on a CPU that has more,
to approximate an AVX2-only machine: there its first run, a run that compiles the quantization
kernels, and a run after it (the kernels loaded from inductor's cache); and short runs with eager
quantization, compiled with a warm cache and compiled with a cold one. Each is a fresh process, so
launch, data, dtype probe, compiles, training, the bf16 baseline measurement and the summary are all
inside the time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "wall time of whole `agoq train` runs: the default, and a short run eager / compiled (warm and cold cache)"


# Held to AVX2: torch's own kernels (ATen, and inductor's generated code) and oneDNN's matmuls use
# no instruction above AVX2, so bf16 is emulated as on an AVX2-only CPU. Same cores and clock as the
# host, so it is an approximation of such a machine, named as one in the results.
AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Run lengths."""
    parser.add_argument("--steps", type=int, default=200, help="steps of the default run (its own default: 200)")
    parser.add_argument("--short-steps", type=int, default=5, help="steps of the short runs")
    parser.add_argument(
        "--no-avx2-row",
        action="store_true",
        help="skip the default run held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) on a CPU with more than AVX2",
    )
    add_out_dir(parser)  # the runs themselves go to temporary folders


def _graphs_cached(cache_dir: str) -> tuple[int, int]:
    """(distinct graphs, entries) in inductor's FX graph cache in ``cache_dir``: after a cold run, the
    graphs it compiled, and how many compiles wrote one (processes that compiled a graph at the same
    time each write an entry; a process that finds one loads it and writes nothing)."""
    import os

    root = os.path.join(cache_dir, "fxgraph")
    if not os.path.isdir(root):
        return 0, 0
    keys = [os.path.join(root, p, k) for p in os.listdir(root) for k in os.listdir(os.path.join(root, p))]
    return len(keys), sum(len(os.listdir(k)) for k in keys)


def _first_run(folder: str) -> dict[str, str]:
    """The environment of a run on a machine where nothing was compiled or cached yet, in ``folder``.

    Inductor keeps its precompiled headers under the default cache folder (the temporary folder's
    ``torchinductor_<user>``) even when TORCHINDUCTOR_CACHE_DIR names another: a fresh
    TORCHINDUCTOR_CACHE_DIR alone left them built, and a first run on a new machine builds them
    too. So the temporary folder itself is a fresh one, the graph cache a folder inside it, and so
    is agoq's cache of the tokenizer and token files (a first run builds them).
    """
    import os

    return {"TMPDIR": folder, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"), "AGOQ_CACHE_DIR": os.path.join(folder, "agoq")}


def _timed(label: str, overrides: list[str], env: dict[str, str], count_graphs: bool = False) -> dict[str, Any]:
    """One `agoq train` run's wall time and opening lines; with ``count_graphs`` (a run that starts
    from an empty cache), also the graphs it compiled."""
    import os

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "agoq", "train", *overrides, f"--train.out_dir={out}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{label} failed:\n{proc.stderr[-2000:]}")
    opening = [line for line in proc.stdout.splitlines() if line.startswith("agoq train:")]
    row = {"run": label, "overrides": overrides, "env": env, "wall_s": wall, "opening_lines": opening}
    if count_graphs:
        row["graphs_compiled"], row["compiles"] = _graphs_cached(env["TORCHINDUCTOR_CACHE_DIR"])
    return row


def run(args: argparse.Namespace) -> int:
    """Time the runs one after another and write run_time.json."""
    from benchmarks._common import RESULTS_DIR, write_result
    from agoq.launch.choices import cpu_flags

    short = [f"--train.steps={args.short_steps}", "--checkpoint.every=0"]
    steps = [f"--train.steps={args.steps}"]
    compiled = ["--precision.quant_backend=compiled"]
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as held_first, tempfile.TemporaryDirectory() as cold_cache:
        rows = [_timed("default, first run", steps, _first_run(first), count_graphs=True)]
        if not args.no_avx2_row and cpu_flags(("avx512f",)):
            held = {**AVX2_ONLY_ENV, **_first_run(held_first)}
            rows += [
                _timed("default, held to AVX2, first run", steps, held, count_graphs=True),
                # The same machine: a run told to compile, then the default again, which now finds
                # this configuration's kernels in the cache (agoq.launch.choices).
                _timed("default, held to AVX2, compiling its kernels", [*steps, *compiled], held, count_graphs=True),
                _timed("default, held to AVX2, after a compiled run", steps, held),
            ]
        rows += [
            _timed(f"{args.short_steps} steps, eager quantization", [*short, "--precision.quant_backend=torch"], {}),
            _timed(f"{args.short_steps} steps, compiled, cold cache", [*short, *compiled], _first_run(cold_cache), count_graphs=True),
            _timed(f"{args.short_steps} steps, compiled, warm cache", [*short, *compiled], _first_run(cold_cache)),  # the one above's
        ]
    results = {"rows": rows, "history": history(Path(args.out_dir or RESULTS_DIR) / "run_time.json")}
    flag = (" --no-avx2-row" if args.no_avx2_row else "") + (f" --out-dir {args.out_dir}" if args.out_dir else "")
    write_result(
        "run_time",
        results,
        command=f"python -m benchmarks.run_time --steps {args.steps} --short-steps {args.short_steps}{flag}",
        out_dir=args.out_dir,
    )
    print(readme_markdown(results))
    return 0


def history(path: Path) -> list[dict[str, Any]]:
    """The earlier results' headlines: each run's wall seconds (benchmarks._common.result_history)."""
    from benchmarks._common import result_history

    return result_history(path, lambda rows: {"wall_s": {r["run"]: round(r["wall_s"], 1) for r in rows}})


def readme_markdown(results: dict[str, Any]) -> str:
    """The runs' wall times as a markdown table."""
    lines = ["| `agoq train` run | wall s | graphs compiled (compiles) | what it chose (its opening lines) |", "|---|---:|---:|---|"]
    for r in results["rows"]:
        # The lines that say what this machine got and why; the full opening lines are in the JSON.
        chosen = [line.removeprefix("agoq train: ") for line in r["opening_lines"]]
        chosen = [line for line in chosen if line.startswith(("compute dtype", "quantization", "activations"))]
        env = "".join(f" `{k}={v}`" for k, v in r["env"].items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TMPDIR", "AGOQ_CACHE_DIR"))
        graphs = f"{r['graphs_compiled']} ({r['compiles']})" if "graphs_compiled" in r else ""
        lines.append(f"| {r['run']}{env} | {r['wall_s']:.0f} | {graphs} | {'; '.join(chosen).replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.run_time``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_time", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
