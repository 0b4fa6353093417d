"""What each fused AGoQ op adds to a decoder layer: forward + backward of the op against the bf16
policy's plain ops on the same tensors, one op at a time.

The step profile (benchmarks.step_profile) says which category of a whole step grows; this says
which op, at a model's own shapes (one micro-batch of tokens), so that a change to one op is
measured on that op. Both sides run interleaved in each round, on one thread; the table gives the
median of each and the median of the per-round ratio. With ``--against REV`` the fused ops of
revision REV (``agoq/activation/ops.py`` read from git) run in the same rounds as a third side: a
change to an op is then measured before and after in one process, where separate invocations on a
shared machine differ by more than the change.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from benchmarks._common import add_out_dir

DESCRIPTION = "forward + backward time of each fused AGoQ op (norm + GEMMs, SwiGLU + GEMM) against the bf16 policy's ops, at a model's shapes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, tokens, dtype, rounds and output folder."""
    parser.add_argument("--model", default="small", help="model preset whose layer shapes are used (tiny, small)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the micro-batch (the step profile's: 4 x 128)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="compute dtype")
    parser.add_argument("--backend", default="compiled", choices=("torch", "compiled"), help="quantization backend of the AGoQ ops")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: what each worker of the default run gets on 2 cores)")
    parser.add_argument("--against", default=None, metavar="REV", help="also time the fused ops of git revision REV in the same rounds")
    add_out_dir(parser)


def ops_at(revision: str) -> ModuleType:
    """agoq.activation.ops as it was at git ``revision``, loaded as a module of its own (it imports
    the rest of agoq from this tree)."""
    root = Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(
            ["git", "show", f"{revision}:src/agoq/activation/ops.py"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--against {revision}: cannot read src/agoq/activation/ops.py at that revision ({e})") from None
    module = ModuleType(f"agoq_ops_at_{revision}")
    sys.modules[module.__name__] = module  # torch.compile looks its functions' module up by name
    exec(compile(source, f"{revision}:src/agoq/activation/ops.py", "exec"), module.__dict__)  # noqa: S102 - this repository's own history
    return module


def _ops(model: str, tokens: int, dtype: Any) -> dict[str, Callable[[Any, Any], None]]:
    """Each fused op's forward + backward as a function of the format (None: the bf16 policy's ops)
    and of the module that implements it (agoq.activation.ops, or :func:`ops_at` a revision)."""
    import torch

    from agoq.models.config import PRESETS

    m = PRESETS[model]
    kv = m.n_kv_heads * m.head_dim
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()

    x, norm_w = leaf(tokens, m.hidden), torch.ones(m.hidden, dtype=dtype, requires_grad=True)
    qkv = [leaf(m.hidden, m.hidden, scale=0.02), leaf(kv, m.hidden, scale=0.02), leaf(kv, m.hidden, scale=0.02)]
    gate_up = [leaf(m.intermediate, m.hidden, scale=0.02), leaf(m.intermediate, m.hidden, scale=0.02)]
    gate, up, down = leaf(tokens, m.intermediate), leaf(tokens, m.intermediate), leaf(m.hidden, m.intermediate, scale=0.02)

    def norm_linear(weights: list[torch.Tensor]) -> Callable[[Any, Any], None]:
        def step(fmt: Any, ops: Any) -> None:
            outs = ops.rms_norm_linear(x, norm_w, m.norm_eps, weights, fmt)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        return step

    def swiglu(fmt: Any, ops: Any) -> None:
        out = ops.swiglu_linear(gate, up, down, fmt)
        out.backward(torch.ones_like(out))

    return {"norm + q/k/v GEMMs": norm_linear(qkv), "norm + gate/up GEMMs": norm_linear(gate_up), "SwiGLU + down GEMM": swiglu}


def run(args: argparse.Namespace) -> int:
    """Time each op both ways, interleaved; write op_overhead.json and print the table."""
    import torch

    from benchmarks._common import RESULTS_DIR, same_round_ratio, write_result
    from agoq.activation import ops
    from agoq.activation.policy import DEFAULT_ACTIVATION_FORMAT
    from agoq.quant import backend, parse_format

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    fmt = parse_format(DEFAULT_ACTIVATION_FORMAT)
    sides = {"bf16 policy": (None, ops), "agoq": (fmt, ops)}
    if args.against:
        sides[f"agoq at {args.against}"] = (fmt, ops_at(args.against))
    rows = []
    with backend.use_backend(args.backend):
        for name, step in _ops(args.model, args.tokens, dtype).items():
            times: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(args.rounds + 2):  # two warm-up rounds (compilation, allocator)
                for side, (f, module) in sides.items():
                    t0 = time.perf_counter()
                    step(f, module)
                    if r >= 2:
                        times[side].append(time.perf_counter() - t0)
            base, agoq = (statistics.median(times[s]) for s in ("bf16 policy", "agoq"))
            row = {
                "op": name,
                "bf16_policy_ms": base * 1e3,
                "agoq_ms": agoq * 1e3,
                "ratio": agoq / base,
                "ratio_same_round": same_round_ratio(times["agoq"], times["bf16 policy"]),
            }
            if args.against:
                row.update(against=args.against, against_ms=statistics.median(times[f"agoq at {args.against}"]) * 1e3)
                row["against_ratio_same_round"] = same_round_ratio(times[f"agoq at {args.against}"], times["bf16 policy"])
            rows.append(row)
    results = {
        "model": args.model,
        "tokens": args.tokens,
        "dtype": args.dtype,
        "backend": args.backend,
        "format": fmt.name,
        "threads": args.threads,
        "rounds": args.rounds,
        "rows": rows,
    }
    results["history"] = history(Path(args.out_dir or RESULTS_DIR) / "op_overhead.json")
    cmd = (
        f"python -m benchmarks.op_overhead --model {args.model} --tokens {args.tokens} --dtype {args.dtype} "
        f"--backend {args.backend} --rounds {args.rounds} --threads {args.threads}"
    ) + (f" --against {args.against}" if args.against else "")
    if args.out_dir:
        cmd += f" --out-dir {args.out_dir}"
    write_result("op_overhead", results, command=cmd, out_dir=args.out_dir)
    print(readme_markdown(results))
    return 0


def history(path: Path) -> list[dict[str, Any]]:
    """The earlier results' headlines, with each op's same-round ratio (benchmarks._common.result_history)."""
    from benchmarks._common import result_history

    return result_history(path, lambda rows: {"ratio_same_round": {r["op"]: round(r["ratio_same_round"], 3) for r in rows}})


def readme_markdown(results: dict[str, Any]) -> str:
    """The table of ops: each side's median and the ratios."""
    lines = [
        f"{results['model']} layer, {results['tokens']} tokens, {results['dtype']}, {results['backend']} quantization, "
        f"{results['threads']} thread(s), median of {results['rounds']} interleaved rounds",
        "",
    ]
    against = results["rows"][0].get("against") if results["rows"] else None
    extra = f" AGoQ at {against} ms | same round, AGoQ at {against} |" if against else ""
    lines += [
        "| op, forward + backward | bf16 policy ms | AGoQ ms | AGoQ / bf16 policy | same round |" + extra,
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if against else ""),
    ]
    for r in results["rows"]:
        line = f"| {r['op']} | {r['bf16_policy_ms']:.2f} | {r['agoq_ms']:.2f} | {r['ratio']:.2f}x | {r['ratio_same_round']:.2f}x |"
        if against:
            line += f" {r['against_ms']:.2f} | {r['against_ratio_same_round']:.2f}x |"
        lines.append(line)
    for h in results.get("history", []):
        ratios = ", ".join(f"{op} {ratio:.2f}x" for op, ratio in h["ratio_same_round"].items())
        lines.append(f"\nEarlier, revision {h['git_revision']} ({h['date'][:10]}, {h.get('processor') or '?'}), same round: {ratios}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.op_overhead``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.op_overhead", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
