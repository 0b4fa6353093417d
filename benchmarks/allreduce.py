"""8-bit all-reduce against fp32 and bf16 all-reduce: bytes on the wire and time (paper Table 4).

Two settings, side by side in one run:

- ``local``: W gloo ranks on this machine over loopback. Per message size: time of torch's fp32
  and bf16 all-reduce, of the 8-bit all-reduce, and of its phases run one after another
  (quantize, all-to-all, reduce = dequantize + fp32 sum + re-quantize, all-gather, dequantize),
  with the bytes each rank sends (agoq.gradient's counters) and the 8-bit result's error.
- ``netns``: two simulated hosts, network namespaces joined by a veth pair whose egress is shaped
  with ``tc qdisc tbf`` (1 Gbit, 100 Mbit), 2 ranks per host. Besides the counted bytes, the bytes
  that actually crossed the link (veth tx counters, TCP headers included) are read per operation.
  Needs root and iproute2; it is skipped with the reason otherwise. Namespaces are always removed.

Besides fp32, bf16 and the 8-bit all-reduce, both settings time a flat int4/64 all-reduce
(``int4``) and the two-hop ``hier-8/4`` (agoq.gradient.hierarchical): int8 reduce-scatter within a
node, int4 all-reduce between nodes, all-gather within a node. A node is LOCAL_WORLD_SIZE ranks
(2 per host in ``netns``), 2 simulated ones when it is not set (``local``). Where the ranks span
hosts (``netns``), the 8-bit and int4 all-reduces gather between hosts, then within each, as
training does across nodes (agoq.gradient.collectives.gathers_by_node). ``ring8`` is the FP8-LM-style
baseline AGoQ's all-reduce replaces (benchmarks/_ring8.py's ring_all_reduce_8bit: one shared
scale, partial sums re-rounded to 8 bits at each hop); benchmarks.convergence trains with it.

Times are the slowest rank's, median over ``--reps``; "same repetition" ratios are the median of
each repetition's ratio (the methods take turns within a repetition, in an order shuffled each
repetition, seeded by it so every rank runs the same one: on 4 ranks over 2 cores the same 8-bit
code measured 1.09-1.35x slower run right after gloo's fp32 all-reduce than two places later, at
2-16 MiB, and a fixed order, rotated or not, keeps each method after the same one).
Each rank uses one thread.
Each method's CPU time is recorded too (the busiest rank's process CPU seconds, gloo's threads
included): over loopback, where bytes cost little and the ranks share the cores, it is what the
methods compete on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_out_dir

DESCRIPTION = "8-bit vs fp32/bf16 all-reduce: wire bytes and time per phase, locally and over two tc-shaped network namespaces"

METHODS = ("fp32", "bf16", "8bit", "int4", "hier-8/4", "ring8")
PARTS = ("quantize", "all_to_all", "reduce", "all_gather", "dequantize")
# The 4-bit wire format of the "int4" (flat) method and of the hierarchical method's inter-node hop.
INT4_FMT = "int4/64"  # precision.gradients=int4 and hier-8/4's (agoq.gradient.sync.INT4_WIRE_FORMAT)
# The hierarchical all-reduce's phases: int8 reduce-scatter within a node, int4 all-reduce between
# nodes, all-gather of the int4 bytes within a node, dequantize.
HIER_PARTS = ("hier_intra_reduce_scatter", "hier_inter_all_reduce", "hier_intra_all_gather", "dequantize")
PARTS_OF = {"8bit": PARTS, "hier-8/4": HIER_PARTS}
DEFAULT_SIZES = "32K,256K,2M,4M,8M,16M,64M"
DEFAULT_NETNS_SIZES = "1M,8M,32M"
DEFAULT_RATES = "1gbit,100mbit"


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    try:
        return int(float(text.rstrip("KMG")) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad message size {text!r}; use e.g. 32K, 2M, 64M") from None


def _sizes(text: str) -> list[int]:
    sizes = [_parse_size(s) for s in text.split(",") if s.strip()]
    if any(s < 4 for s in sizes):
        raise argparse.ArgumentTypeError(f"message sizes must be at least 4 bytes, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.allreduce``."""
    parser.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SIZES), help=f"fp32 message sizes, local run (default {DEFAULT_SIZES})")
    parser.add_argument("--ranks", type=int, default=4, help="local ranks (default 4)")
    parser.add_argument(
        "--reps",
        type=int,
        default=20,
        help="timed repetitions per size, the methods taking turns in a shuffled order; median reported (default 20)",
    )
    parser.add_argument(
        "--netns-sizes",
        type=_sizes,
        default=_sizes(DEFAULT_NETNS_SIZES),
        help=f"fp32 message sizes over the shaped link (default {DEFAULT_NETNS_SIZES})",
    )
    parser.add_argument("--rates", default=DEFAULT_RATES, help=f"link rates for tc tbf, comma-separated (default {DEFAULT_RATES}; empty: skip)")
    parser.add_argument("--only", choices=("local", "netns"), default=None, help="run one setting only")
    parser.add_argument("--fmt", default="int8/256", help="8-bit wire format (default int8/256)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of markdown tables")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    add_out_dir(parser)
    # Internal: one rank of the netns run, started by this module inside a namespace.
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--link", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)


# ---- measurement, run on every rank -----------------------------------------------------------


def _tx_bytes(link: str) -> int:
    return int(Path(f"/sys/class/net/{link}/statistics/tx_bytes").read_text()) if link else 0


def node_size(world: int) -> int:
    """Ranks per node of the hierarchical method: LOCAL_WORLD_SIZE (as torchrun sets it), else 2 simulated nodes' worth."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or 2
    return local if world % local == 0 else 1


def measure(rank: int, world: int, sizes: list[int], reps: int, fmt: str, link: str = "") -> list[dict[str, Any]]:
    """Rows of measurements for each size and method (every rank returns the same rows)."""
    import torch
    import torch.distributed as dist

    from agoq.gradient import CommCounter, all_reduce_8bit, all_reduce_hierarchical, node_groups
    from agoq.gradient.collectives import all_reduce_fp, inter_node_name
    from benchmarks._ring8 import ring_all_reduce_8bit

    groups = node_groups(node_size(world))
    # The flat all-reduces know the nodes only where the ranks really span hosts, as in training.
    spans_hosts = int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world
    flat_nodes = groups if spans_hosts else None

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    rows = []
    for size in sizes:
        n = size // 4
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(n, generator=gen)
        exact = x.double()
        dist.all_reduce(exact)
        counters = {method: CommCounter() for method in METHODS}

        def op(method: str, t: torch.Tensor, timings: dict[str, float] | None = None) -> None:
            if method == "8bit":
                all_reduce_8bit(t, fmt=fmt, counter=counters[method], timings=timings, nodes=flat_nodes)
            elif method == "int4":
                all_reduce_8bit(t, fmt=INT4_FMT, counter=counters[method], timings=timings, nodes=flat_nodes)
            elif method == "hier-8/4":
                all_reduce_hierarchical(t, "sum", groups, intra_fmt=fmt, inter_fmt=INT4_FMT, counter=counters[method], timings=timings)
            elif method == "ring8":
                ring_all_reduce_8bit(t, "sum", counter=counters[method])
            else:
                all_reduce_fp(t, counter=counters[method])

        bases = {method: x.bfloat16() if method == "bf16" else x for method in METHODS}
        errors = {}
        for method in METHODS:
            y = bases[method].clone()
            op(method, y)  # warm-up, and the result whose error is reported
            errors[method] = float((y.double() - exact).norm() / exact.norm())
            counters[method].reset()
        # The methods take turns within each repetition, so a change in the machine's load
        # (4 ranks share the cores) falls on all of them alike instead of on whichever ran then,
        # in an order shuffled each repetition, so that each method follows each of the others.
        times: dict[str, list[float]] = {method: [] for method in METHODS}
        cpu: dict[str, list[float]] = {method: [] for method in METHODS}
        tx: dict[str, float] = dict.fromkeys(METHODS, 0.0)
        for rep in range(reps):
            order = list(METHODS)
            random.Random(rep).shuffle(order)  # the same order on every rank: they run collectives together
            for method in order:
                y = bases[method].clone()
                dist.barrier()
                tx0 = _tx_bytes(link)
                c0, t0 = time.process_time(), time.perf_counter()
                op(method, y)
                elapsed = time.perf_counter() - t0
                # The process's CPU time, gloo's threads included: on loopback the ranks share the
                # cores, so this, not the bytes, is what the methods compete on.
                cpu_s = time.process_time() - c0
                dist.barrier()
                tx[method] += _tx_bytes(link) - tx0
                times[method].append(slowest(elapsed))
                cpu[method].append(slowest(cpu_s))
        for method in METHODS:
            counter = counters[method]
            row: dict[str, Any] = {
                "size_bytes": size,
                "numel": n,
                "method": method,
                "time_s": statistics.median(times[method]),
                "times_s": times[method],
                "cpu_s": statistics.median(cpu[method]),  # the busiest rank's CPU seconds, median over reps
                "wire_bytes_per_rank": counter.bytes() // reps,
                "payload_bytes_per_rank": sum(counter.payload.values()) // reps,
                "scale_bytes_per_rank": sum(counter.scales.values()) // reps,
                "rel_l2_error": errors[method],
            }
            if link:
                row["link_tx_bytes_per_op"] = tx[method] / reps
            if method == "hier-8/4":
                row["node_size"] = groups.node_size
                row["inter_node_bytes_per_rank"] = counter.bytes(HIER_PARTS[1]) // reps
            elif method in ("8bit", "int4") and spans_hosts:
                row["gathered_by_node"] = True
                row["inter_node_bytes_per_rank"] = counter.bytes(inter_node_name("all_reduce_8bit")) // reps
            if method in PARTS_OF:
                parts: dict[str, list[float]] = {p: [] for p in PARTS_OF[method]}
                for _ in range(reps):
                    timings: dict[str, float] = {}
                    dist.barrier()
                    op(method, x.clone(), timings)
                    for p in parts:
                        parts[p].append(slowest(timings.get(p, 0.0)))
                row["parts_s"] = {p: statistics.median(v) for p, v in parts.items()}
            rows.append(row)
    return rows


def _local_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, fmt: str, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = measure(rank, world, sizes, reps, fmt)
        queue.put((rank, "ok", rows))
    except BaseException as e:  # reported to the parent, which fails the run
        queue.put((rank, "error", repr(e)))
    finally:
        dist.destroy_process_group()


def run_local(world: int, sizes: list[int], reps: int, fmt: str) -> list[dict[str, Any]]:
    """Rows of :func:`measure` from ``world`` spawned local gloo ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    from agoq.launch.loopback import free_port

    port = free_port()
    procs = [ctx.Process(target=_local_worker, args=(r, world, port, sizes, reps, fmt, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict()
    for _ in range(world):
        rank, status, value = queue.get()
        if status != "ok":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed: {value}")
        results[rank] = value
    for p in procs:
        p.join()
    return results[0]


# ---- two simulated hosts ----------------------------------------------------------------------


def netns_unavailable() -> str | None:
    """Why the netns run cannot happen here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or use --only local)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found; install iproute2 (apt-get install -y iproute2)"
    return None


class _TwoHosts:
    """Namespaces A and B joined by a veth pair shaped to ``rate`` each way; removed on exit."""

    def __init__(self, rate: str) -> None:
        # benchmarks/netns_allreduce.sh passes its own pid so that its trap knows the names.
        tag = os.environ.get("AGOQ_NETNS_TAG") or f"{os.getpid() % 100000}"
        self.ns = (f"agoq-a{tag}", f"agoq-b{tag}")
        self.links = (f"agq{tag}a", f"agq{tag}b")
        self.addrs = ("10.213.0.1", "10.213.0.2")
        self.rate = rate

    def __enter__(self) -> "_TwoHosts":
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "link", "add", self.links[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.links[1], "netns", self.ns[1])
            rate_bytes = _rate_bytes(self.rate)
            burst = max(32 * 1024, rate_bytes // 100)  # 10 ms of traffic
            for ns, link, addr in zip(self.ns, self.links, self.addrs):
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
                _sh("ip", "-n", ns, "link", "set", link, "up")
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    link,
                    "root",
                    "tbf",
                    "rate",
                    self.rate,
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # Deleting a namespace deletes its end of the veth pair, and with it the peer.
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _rate_bytes(rate: str) -> int:
    r = rate.lower().removesuffix("bit")
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}.get(r[-1:], 1)
    return int(float(r.rstrip("kmg")) * mult / 8)


def _sh(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")


def run_netns(rate: str, sizes: list[int], reps: int, fmt: str, timeout_s: float = 900) -> list[dict[str, Any]]:
    """Rows of :func:`measure` from 4 ranks, 2 in each of two namespaces linked at ``rate``."""
    with _TwoHosts(rate) as hosts, tempfile.TemporaryDirectory() as tmp:
        port = 29500 + os.getpid() % 1000
        procs = []
        for rank in range(4):
            host = rank // 2
            out = os.path.join(tmp, f"rank{rank}.json")
            cmd = [
                "ip",
                "netns",
                "exec",
                hosts.ns[host],
                sys.executable,
                "-m",
                "benchmarks.allreduce",
                "--worker",
                str(rank),
                "--world",
                "4",
                "--master",
                hosts.addrs[0],
                "--port",
                str(port),
                "--link",
                hosts.links[host],
                "--out",
                out,
                "--reps",
                str(reps),
                "--fmt",
                fmt,
                "--netns-sizes",
                ",".join(str(s) for s in sizes),
            ]
            # The rank imports this module as benchmarks.allreduce from whatever folder it starts in.
            root = str(Path(__file__).resolve().parents[1])
            path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
            # As torchrun would set them for 2 hosts of 2 ranks (the 8-bit all-gather reads them).
            env = dict(os.environ, GLOO_SOCKET_IFNAME=hosts.links[host], OMP_NUM_THREADS="1", PYTHONPATH=path, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout_s
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs):
            raise RuntimeError("netns rank failed:\n" + "\n".join(logs))
        rows = json.loads(Path(tmp, "rank0.json").read_text())
        # Rank 0 counted host A's egress, rank 2 host B's: report both directions.
        rows_b = json.loads(Path(tmp, "rank2.json").read_text())
        for a, b in zip(rows, rows_b):
            a["link_tx_bytes_per_op"] = {"a_to_b": a.pop("link_tx_bytes_per_op"), "b_to_a": b["link_tx_bytes_per_op"]}
        return rows


def _netns_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.worker, world_size=args.world)
    try:
        rows = measure(args.worker, args.world, args.netns_sizes, args.reps, args.fmt, args.link)
    finally:
        dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(rows))
    return 0


# ---- report -----------------------------------------------------------------------------------


def _by(rows: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["size_bytes"], {})[r["method"]] = r
    return out


def _human(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n:.0f} B"


def history(path: Path) -> list[dict[str, Any]]:
    """The earlier results' headlines: each loopback size's 8-bit / fp32 time, medians and same
    repetition (benchmarks._common.result_history)."""
    from benchmarks._common import result_history

    def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
        pairs = [(_human(size), m["8bit"], m["fp32"]) for size, m in sorted(_by(rows).items()) if "8bit" in m and "fp32" in m]
        return {
            "local_8bit_vs_fp32": {label: round(a["time_s"] / b["time_s"], 3) for label, a, b in pairs},
            "local_8bit_vs_fp32_same_repetition": {label: round(paired_ratio(a, b), 3) for label, a, b in pairs},
        }

    return result_history(path, ratios, rows_of=lambda results: results["local"]["rows"])


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Median over repetitions of a's time / b's time in the same repetition (the methods take
    turns within each one)."""
    from benchmarks._common import same_round_ratio

    return same_round_ratio(a["times_s"], b["times_s"])


def local_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: times, parts and bytes per size, with ratios to fp32."""
    lines = [
        "| message (fp32) | fp32 ms | bf16 ms | 8-bit ms | 8-bit / fp32 time | same repetition | CPU ms per rank fp32 / 8-bit | quantize | all-to-all | reduce | all-gather | dequantize | bytes/rank fp32 | bf16 | 8-bit | 8-bit / fp32 bytes | 8-bit rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, m in sorted(_by(rows).items()):
        f, b, q = m["fp32"], m["bf16"], m["8bit"]
        parts = " | ".join(f"{1e3 * q['parts_s'][p]:.2f}" for p in PARTS)
        cpu = f"{1e3 * f['cpu_s']:.2f} / {1e3 * q['cpu_s']:.2f}" if "cpu_s" in q else "-"  # results before CPU times were taken
        lines.append(
            f"| {_human(size)} | {1e3 * f['time_s']:.2f} | {1e3 * b['time_s']:.2f} | {1e3 * q['time_s']:.2f} | "
            f"{q['time_s'] / f['time_s']:.2f}x | {paired_ratio(q, f):.2f}x | {cpu} | {parts} | {_human(f['wire_bytes_per_rank'])} | "
            f"{_human(b['wire_bytes_per_rank'])} | {_human(q['wire_bytes_per_rank'])} | "
            f"{q['wire_bytes_per_rank'] / f['wire_bytes_per_rank']:.3f}x | {q['rel_l2_error']:.2e} |"
        )
    return "\n".join(lines)


def four_bit_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: the flat int4 and the hierarchical (int8 within a node, int4 between nodes) all-reduce against fp32 and 8-bit."""
    lines = [
        "| message (fp32) | fp32 ms | 8-bit ms | int4 ms | hier-8/4 ms | fp32 / hier-8/4 time | 8-bit / hier-8/4 time | intra reduce-scatter | inter all-reduce | intra all-gather | "
        "bytes/rank int4 | hier-8/4 | hier-8/4 inter-node | hier inter-node / fp32 | int4 rel. error | hier-8/4 rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, m in sorted(_by(rows).items()):
        if "hier-8/4" not in m or "int4" not in m:
            continue
        f, q, i4, h = m["fp32"], m["8bit"], m["int4"], m["hier-8/4"]
        parts = " | ".join(f"{1e3 * h['parts_s'][p]:.2f}" for p in HIER_PARTS[:3])
        lines.append(
            f"| {_human(size)} | {1e3 * f['time_s']:.2f} | {1e3 * q['time_s']:.2f} | {1e3 * i4['time_s']:.2f} | {1e3 * h['time_s']:.2f} | "
            f"{f['time_s'] / h['time_s']:.2f}x | {q['time_s'] / h['time_s']:.2f}x | {parts} | {_human(i4['wire_bytes_per_rank'])} | {_human(h['wire_bytes_per_rank'])} | "
            f"{_human(h['inter_node_bytes_per_rank'])} | {h['inter_node_bytes_per_rank'] / f['wire_bytes_per_rank']:.3f}x | "
            f"{i4['rel_l2_error']:.2e} | {h['rel_l2_error']:.2e} |" + (f" {_link(h) / _link(f):.3f}x |" if "link_tx_bytes_per_op" in h else "")
        )
    if any("link_tx_bytes_per_op" in r for r in rows):
        # Over the shaped link, the bytes that crossed it (veth counters, TCP headers included).
        lines[0] += " hier-8/4 / fp32 bytes across the link |"
        lines[1] += "---|"
    return "\n".join(lines)


def _link(row: dict[str, Any]) -> float:
    return sum(row["link_tx_bytes_per_op"].values())


def netns_table(by_rate: dict[str, Any]) -> str:
    """Markdown: per link rate and size, times and the bytes that crossed the link."""
    lines = [
        "| link | message (fp32) | fp32 ms | bf16 ms | 8-bit ms | fp32 / 8-bit time | same repetition | bf16 / 8-bit time | link bytes per op fp32 | bf16 | 8-bit | 8-bit / fp32 link bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, res in by_rate.items():
        if "skipped" in res:
            lines.append(f"| {rate} | skipped: {res['skipped']} ||||||||||")
            continue
        for size, m in sorted(_by(res["rows"]).items()):
            f, b, q = m["fp32"], m["bf16"], m["8bit"]
            link = {k: sum(v["link_tx_bytes_per_op"].values()) for k, v in m.items()}
            lines.append(
                f"| {rate} | {_human(size)} | {1e3 * f['time_s']:.1f} | {1e3 * b['time_s']:.1f} | {1e3 * q['time_s']:.1f} | "
                f"{f['time_s'] / q['time_s']:.2f}x | {paired_ratio(f, q):.2f}x | {b['time_s'] / q['time_s']:.2f}x | {_human(link['fp32'])} | "
                f"{_human(link['bf16'])} | {_human(link['8bit'])} | {link['8bit'] / link['fp32']:.3f}x |"
            )
    return "\n".join(lines)


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("local gloo, loopback", results.get("local", {}).get("rows"))]
    panels += [(f"two hosts, {rate}", res.get("rows")) for rate, res in results.get("netns", {}).items()]
    panels = [(t, r) for t, r in panels if r]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        by = _by(rows)
        sizes = sorted(by)
        for method in [m for m in METHODS if all(m in by[s] for s in sizes)]:
            ax.plot([s / 2**20 for s in sizes], [1e3 * by[s][method]["time_s"] for s in sizes], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message (fp32 MiB)")
        ax.set_ylabel("all-reduce time, slowest rank (ms)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; write allreduce.json (+ .png) into --out-dir or benchmarks/results; print tables."""
    if args.worker is not None:
        return _netns_worker(args)
    from benchmarks._common import RESULTS_DIR, write_result

    if args.ranks < 2:
        raise SystemExit(f"--ranks must be at least 2, got {args.ranks}")
    # Times on a shared machine depend on its load: record it beside them.
    results: dict[str, Any] = {"fmt": args.fmt, "reps": args.reps, "loadavg_before": os.getloadavg()}
    if args.only in (None, "local"):
        t0 = time.monotonic()
        results["local"] = {
            "ranks": args.ranks,
            "backend": "gloo",
            "link": "loopback",
            "rows": run_local(args.ranks, args.sizes, args.reps, args.fmt),
        }
        results["local"]["seconds"] = round(time.monotonic() - t0, 1)
    if args.only in (None, "netns"):
        results["netns"] = {}
        reason = netns_unavailable()
        # SIGTERM must unwind through the namespaces' __exit__ like Ctrl-C does.
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
                if reason:
                    results["netns"][rate] = {"skipped": reason}
                    continue
                t0 = time.monotonic()
                rows = run_netns(rate, args.netns_sizes, args.reps, args.fmt)
                results["netns"][rate] = {"ranks": 4, "hosts": 2, "ranks_per_host": 2, "rows": rows, "seconds": round(time.monotonic() - t0, 1)}
        finally:
            signal.signal(signal.SIGTERM, previous)
        if reason:
            print(f"two-host run skipped: {reason}", file=sys.stderr)
    results["loadavg_after"] = os.getloadavg()
    results["history"] = history(Path(args.out_dir or RESULTS_DIR) / "allreduce.json")
    path = write_result("allreduce", results, out_dir=args.out_dir)
    if not args.no_plot:
        _plot(results, path.with_suffix(".png"))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    if "local" in results:
        print(f"### 8-bit vs fp32/bf16 all-reduce, {args.ranks} gloo ranks on one machine ({args.fmt})\n")
        print(local_table(results["local"]["rows"]))
        print()
        print(f"### 4-bit: flat int4 and hierarchical (int8 within {node_size(args.ranks)}-rank nodes, int4 between them)\n")
        print(four_bit_table(results["local"]["rows"]))
        print()
    if results.get("netns"):
        print("### Two simulated hosts (veth + tc tbf), 2 ranks per host\n")
        print(netns_table(results["netns"]))
        print()
        for rate, res in results["netns"].items():
            if res.get("rows"):
                print(f"#### {rate}: flat int4 and hierarchical (int8 within a host, int4 between the hosts)\n")
                print(four_bit_table(res["rows"]))
                print()
    print(f"results: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the benchmark (``python -m benchmarks.allreduce``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
