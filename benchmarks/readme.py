"""Regenerate the result tables of README.md and docs/results.md from the committed JSON files (no
number typed by hand).

Each table in docs/results.md sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``
and is rendered from ``benchmarks/results/NAME.json`` by the benchmark module that wrote it,
followed by the command (as it is spelled today: :func:`current_command`), revision, date and
machine recorded in the file. README.md has one block, ``<!-- headline -->``: the trainer-level
comparison of ``train_ratio.json`` where that file exists, else the deterministic figures (bytes,
memory, loss) of ``convergence.json``, with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Callable

DESCRIPTION = "rewrite the result tables of README.md and docs/results.md from benchmarks/results/*.json"

ROOT = Path(__file__).resolve().parents[1]


def _quant_throughput(r: dict[str, Any]) -> str:
    from benchmarks.quant_throughput import _markdown

    return _markdown(r["rows"], r["numel"], r["device"], r["threads"])


def _quant_block_size(r: dict[str, Any]) -> str:
    from benchmarks.quant_block_size import _markdown

    blocks = sorted({row["block"] for row in r["rows"]})
    return _markdown(r["rows"], blocks, r["model"])


def _activation(r: dict[str, Any]) -> str:
    from benchmarks.activation import _markdown

    return _markdown(r["measured"], r.get("analytical", []))


def _grad_error(r: dict[str, Any]) -> str:
    from benchmarks.grad_error import _markdown

    return _markdown(r)


def _loss(r: dict[str, Any]) -> str:
    from benchmarks.loss import _table

    return _table(r["rows"])


def _allreduce(r: dict[str, Any]) -> str:
    from benchmarks.allreduce import four_bit_table, local_table, netns_table

    parts = [local_table(r["local"]["rows"])]
    four = four_bit_table(r["local"]["rows"])
    if four.count("\n") > 1:  # results recorded before the 4-bit methods have no rows for it
        parts.append("Flat int4/64, and the two-hop hier-8/4 (int8 within a node of 2 ranks, int4/64 between the nodes), same run:\n\n" + four)
    if r.get("netns"):
        parts.append("Two simulated hosts (network namespaces, veth shaped with `tc tbf`, 2 ranks per host):\n\n" + netns_table(r["netns"]))
        for rate, res in r["netns"].items():
            four = four_bit_table(res.get("rows", []))
            if four.count("\n") > 1:
                parts.append(f"{rate}, flat int4/64 and hier-8/4 (int8 within a host, int4/64 between the hosts):\n\n" + four)
    return "\n\n".join(parts)


def _plan_vs_paper(r: dict[str, Any]) -> str:
    from benchmarks.plan_vs_paper import markdown

    return markdown(r)


def _launches(r: dict[str, Any]) -> str:
    from benchmarks.launches import readme_markdown

    return readme_markdown(r)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "plan_vs_paper": _plan_vs_paper,
    "quant_throughput": _quant_throughput,
    "quant_block_size": _quant_block_size,
    "activation": _activation,
    "grad_error": _grad_error,
    "loss": _loss,
    "allreduce": _allreduce,
    "launches": _launches,
}


def current_command(command: str) -> str:
    """``command`` as a reader runs it today.

    Result files written while the benchmarks were part of the agoq package record
    ``agoq bench NAME args``; that is now ``python -m benchmarks.NAME args`` (NAME with '_' for '-').
    An ``--out-dir DIR`` is left out: it only put the file somewhere before it was committed, and
    without it the benchmark writes the committed file itself. The files keep what was run; the
    docs show what a reader can run. Any other command is returned as it is.
    """
    command = re.sub(r" --out-dir(?:=| )\S+", "", command.strip())
    m = re.fullmatch(r"agoq bench ([a-z][a-z0-9_-]*)(\s.*)?", command, flags=re.S)
    if m is None:
        return command
    return f"python -m benchmarks.{m.group(1).replace('-', '_')}{m.group(2) or ''}"


def machine_words(payload: dict[str, Any]) -> str:
    """The machine a result file was measured on, in words: CPU, cores, the CPU flags that set its speed, GPU."""
    m = payload.get("machine", {})
    flags = f", flags {'/'.join(f.upper() for f in m['cpu_flags'])}" if m.get("cpu_flags") else ""
    return (
        f"{m.get('processor', '?')}, {m.get('cpu_count', '?')} cores{flags}"
        + (f", {m['gpu']}" if m.get("gpu") else "")
        + f", torch {m.get('torch', '?')}"
    )


def _reproduce(payload: dict[str, Any], detail: str = "") -> str:
    """The README's source line of a result file: its command as run today, date and machine (no revision)."""
    return f"Reproduce: `{current_command(payload['command'])}` (measured {payload['date'][:10]} on {machine_words(payload)}{'; ' + detail if detail else ''})"


def _provenance(payload: dict[str, Any]) -> str:
    return (
        f"<sub>Source: `benchmarks/results/{payload['benchmark']}.json`, produced by `{current_command(payload['command'])}` "
        f"at revision {payload['git_revision']} on {payload['date'][:10]} ({machine_words(payload)}).</sub>"
    )


# Result files that may be absent: measured on a quiet machine, not by every checkout.
OPTIONAL = {
    "train_ratio": "python -m benchmarks.train_ratio --steps 200 --repeats 3",
    "finetune_scale_2048": "python -m benchmarks.finetune_scale --seq-lens 2048",
    "finetune_scale_8192": "python -m benchmarks.finetune_scale --seq-lens 8192",
}


def render(name: str, results_dir: Path) -> str:
    """The markdown block for one result file: its table and where it came from.

    ``NAME/VIEW`` renders the same file through the module's ``VIEW_markdown`` instead of its
    ``readme_markdown`` (a shorter table of the same figures, for the README).
    """
    name, _, view = name.partition("/")
    path = results_dir / f"{name}.json"
    if name in OPTIONAL and not path.exists():
        return f"Not measured yet: `{OPTIONAL[name]}` writes `benchmarks/results/{name}.json`."
    payload = json.loads(path.read_text())
    extra = None if view else RENDERERS.get(name)
    if extra is None:
        from importlib import import_module

        # convergence_<preset>, step_profile_<preset>_<dtype>, lora_hidden<H> and finetune_scale_<tokens> come from one module each
        prefixes = {"convergence_": "convergence", "step_profile_": "step_profile", "lora_hidden": "lora", "finetune_scale_": "finetune_scale"}
        module = next((m for prefix, m in prefixes.items() if name.startswith(prefix)), name)
        extra = getattr(import_module(f"benchmarks.{module}"), f"{view or 'readme'}_markdown")
    if view:  # a shorter view is the README's: its command and machine, no revision (history stays in docs/results.md)
        return extra(payload["results"]).strip() + "\n\n" + _reproduce(payload) + "."
    return extra(payload["results"]).strip() + "\n\n" + _provenance(payload)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _headline_rows(agoq: dict[str, Any], bf16: dict[str, Any]) -> list[str]:
    """The byte rows both headline sources share: largest rank's saved activations and all tensors, wire bytes."""
    rows = []
    for key, what in (
        ("peak_saved_bytes", "saved activations, peak (MiB, largest rank)"),
        ("peak_tensor_bytes", "all tensors at the step's peak (MiB, largest rank)"),
        ("wire_bytes_per_step", "gradient bytes sent per step (MiB, per rank)"),
    ):
        rows.append(f"| {what} | {_mib(bf16[key])} | {_mib(agoq[key])} | {agoq[key] / bf16[key]:.3f}x |")
    return rows


HEADER = ["| | bf16 policy, fp32 gradients | AGoQ | AGoQ / bf16 |", "|---|---:|---:|---:|"]


def _headline_from_train_ratio(payload: dict[str, Any]) -> str:
    from statistics import median

    r = payload["results"]
    first_mode = next(iter(r.get("modes", {"default": []})))
    side = {s: [row for row in r["rows"] if row["side"] == s and row.get("mode", "default") == first_mode] for s in ("agoq", "bf16")}
    first = {s: rows[0] for s, rows in side.items()}
    step = {s: median(row["step_time_s"] for row in rows) for s, rows in side.items()}
    lines = [
        *HEADER,
        f"| step time (s, median of {r['repeats']} alternating runs each) | {step['bf16']:.3f} | {step['agoq']:.3f} | {r['ratios']['step_time_s']:.2f}x |",
    ]
    for mode, q in r.get("ratios_by_mode", {}).items():
        if mode != first_mode and q.get("step_time_s") is not None:
            lines.append(f"| step time, `{' '.join(r['modes'][mode])}` on both sides | | | {q['step_time_s']:.2f}x |")
    lines += _headline_rows(first["agoq"], first["bf16"])
    if first["agoq"].get("val_loss") is not None and first["bf16"].get("val_loss") is not None:
        val = {s: median(row["val_loss"] for row in rows) for s, rows in side.items()}
        lines.append(f"| validation loss (median) | {val['bf16']:.4f} | {val['agoq']:.4f} | {val['agoq'] / val['bf16']:.4f}x |")
    chose = f"compute {first['agoq']['compute_dtype']}, quantization {first['agoq']['quant_backend']}"
    return (
        f"`agoq train`, embedded default, {r['steps']} steps per run; AGoQ against "
        "`--precision.activations=bf16 --precision.gradients=fp32`, taking turns in one invocation.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + _reproduce(payload, chose)
        + "."
    )


def _headline_from_convergence(payload: dict[str, Any]) -> str:
    r = payload["results"]
    rows = {row["name"]: row for row in r["rows"]}
    agoq, bf16 = rows["agoq"], rows["bf16"]
    lines = [*HEADER, *_headline_rows(agoq["max_rank"], bf16["max_rank"])]
    va, vb = agoq["val_loss"], bf16["val_loss"]
    lines.append(
        f"| validation loss (mean ± std of {len(vb['values'])} seeds) | {vb['mean']:.3f} ± {vb['std']:.3f} | {va['mean']:.3f} ± {va['std']:.3f} "
        f"| {va['mean'] / vb['mean']:.4f}x |"
    )
    return (
        f"`agoq train`, embedded default ({r['config']}), {r['steps']} steps; AGoQ against "
        "`--precision.activations=bf16 --precision.gradients=fp32`. The bytes are counted, not timed.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + _reproduce(payload)
        + ". "
        + f"The step-time ratio of whole runs, taking turns, is what `{OPTIONAL['train_ratio']}` measures; it is not committed yet."
    )


def headline(results_dir: Path) -> str:
    """The README's one results table: trainer-level runs from train_ratio.json if it exists, else convergence.json's bytes."""
    ratio = results_dir / "train_ratio.json"
    if ratio.exists():
        return _headline_from_train_ratio(json.loads(ratio.read_text()))
    return _headline_from_convergence(json.loads((results_dir / "convergence.json").read_text()))


def update_file(path: Path, results_dir: Path) -> list[str]:
    """Replace every results block (and the headline block) in one markdown file; return the names updated."""
    text = path.read_text()
    names = re.findall(r"<!-- results:([a-z0-9_/]+) -->", text)
    blocks = {f"results:{name}": lambda name=name: render(name, results_dir) for name in names}
    if "<!-- headline -->" in text:
        blocks["headline"] = lambda: headline(results_dir)
    for marker, make in blocks.items():
        close = "<!-- /" + marker + " -->"
        pattern = re.compile(rf"(<!-- {re.escape(marker)} -->\n).*?({re.escape(close)})", re.S)
        if not pattern.search(text):
            raise ValueError(f"{path.name} has an opening marker for {marker!r} but no {close!r}")
        block = make()
        text = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)
    path.write_text(text)
    return [m.removeprefix("results:") for m in blocks]


# The files whose tables come from the results, relative to the checkout.
GENERATED = ("README.md", "docs/results.md", "docs/compat.md")


def update_readme(readme: Path, results_dir: Path) -> list[str]:
    """README.md's blocks (:func:`update_file`); kept for callers that name the README."""
    return update_file(readme, results_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkout whose files to rewrite and the results folder."""
    parser.add_argument("--root", default=str(ROOT), help="checkout whose README.md and docs/results.md to rewrite in place (default: this one)")
    parser.add_argument(
        "--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the JSON result files (default: the committed ones)"
    )
    parser.add_argument("--check", action="store_true", help="fail if a file differs from what the results give (for CI)")


def run(args: argparse.Namespace) -> int:
    """Rewrite (or, with --check, verify) the result tables of README.md and docs/results.md."""
    stale = []
    for rel in GENERATED:
        path = Path(args.root) / rel
        before = path.read_text()
        names = update_file(path, Path(args.results))
        if args.check:
            if path.read_text() != before:
                stale.append(rel)
            path.write_text(before)
        else:
            print(f"{rel}: updated {len(names)} block(s): {', '.join(names)}")
    if stale:
        print(f"stale result tables in {', '.join(stale)}: run `python -m benchmarks.readme`")
        return 1
    if args.check:
        print(f"{', '.join(GENERATED)} match the result files")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse argv and rewrite the tables (``python -m benchmarks.readme``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
