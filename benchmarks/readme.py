"""Regenerate the README's result tables from the committed JSON files (no number typed by hand).

Each table sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` in README.md and
is rendered from ``benchmarks/results/NAME.json`` by the benchmark module that wrote it, followed
by the command (as it is spelled today: :func:`current_command`), revision, date and machine
recorded in the file.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Callable

DESCRIPTION = "rewrite the README's result tables from benchmarks/results/*.json"

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


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "plan_vs_paper": _plan_vs_paper,
    "quant_throughput": _quant_throughput,
    "quant_block_size": _quant_block_size,
    "activation": _activation,
    "grad_error": _grad_error,
    "loss": _loss,
    "allreduce": _allreduce,
}


def current_command(command: str) -> str:
    """``command`` as it is run today.

    Result files written while the benchmarks were part of the agoq package record
    ``agoq bench NAME args``; that is now ``python -m benchmarks.NAME args`` (NAME with '_' for '-').
    The files keep what was run; the README shows what a reader can run. Any other command is
    returned as it is.
    """
    m = re.fullmatch(r"agoq bench ([a-z][a-z0-9_-]*)(\s.*)?", command.strip(), flags=re.S)
    if m is None:
        return command
    return f"python -m benchmarks.{m.group(1).replace('-', '_')}{m.group(2) or ''}"


def _provenance(payload: dict[str, Any]) -> str:
    m = payload.get("machine", {})
    flags = f", flags {'/'.join(f.upper() for f in m['cpu_flags'])}" if m.get("cpu_flags") else ""
    where = f"{m.get('processor', '?')}, {m.get('cpu_count', '?')} cores{flags}" + (f", {m['gpu']}" if m.get("gpu") else "")
    return (
        f"<sub>Source: `benchmarks/results/{payload['benchmark']}.json`, produced by `{current_command(payload['command'])}` "
        f"at revision {payload['git_revision']} on {payload['date'][:10]} ({where}, torch {m.get('torch', '?')}).</sub>"
    )


def render(name: str, results_dir: Path) -> str:
    """The markdown block for one result file: its table and where it came from."""
    payload = json.loads((results_dir / f"{name}.json").read_text())
    extra = RENDERERS.get(name)
    if extra is None:
        from importlib import import_module

        # convergence_<preset> and step_profile_<preset>_<dtype> come from one module each
        module = "convergence" if name.startswith("convergence_") else "step_profile" if name.startswith("step_profile_") else name
        extra = getattr(import_module(f"benchmarks.{module}"), "readme_markdown")
    return extra(payload["results"]).strip() + "\n\n" + _provenance(payload)


def update_readme(readme: Path, results_dir: Path) -> list[str]:
    """Replace every results block in README.md; return the names updated."""
    text = readme.read_text()
    names = re.findall(r"<!-- results:([a-z0-9_/]+) -->", text)
    for name in names:
        block = render(name, results_dir)
        pattern = re.compile(rf"(<!-- results:{re.escape(name)} -->\n).*?(<!-- /results:{re.escape(name)} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"README has an opening marker for {name!r} but no '<!-- /results:{name} -->'")
        text = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)
    readme.write_text(text)
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Paths of the README and the results folder."""
    parser.add_argument("--readme", default=str(ROOT / "README.md"), help="the README to rewrite in place (default: this checkout's)")
    parser.add_argument(
        "--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the JSON result files (default: the committed ones)"
    )
    parser.add_argument("--check", action="store_true", help="fail if the README differs from what the files give (for CI)")


def run(args: argparse.Namespace) -> int:
    """Rewrite (or, with --check, verify) the README's result tables."""
    readme = Path(args.readme)
    before = readme.read_text()
    names = update_readme(readme, Path(args.results))
    if args.check:
        after = readme.read_text()
        readme.write_text(before)
        if after != before:
            print("README result tables are stale: run `python -m benchmarks.readme`")
            return 1
        print(f"README result tables match {len(names)} result file(s)")
        return 0
    print(f"updated {len(names)} table(s): {', '.join(names)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse argv and rewrite the tables (``python -m benchmarks.readme``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
