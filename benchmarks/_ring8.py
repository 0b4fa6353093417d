"""The FP8-LM-style ring, the scheme AGoQ's all-reduce replaces, as a baseline: the collective
(:func:`ring_all_reduce_8bit`: one shared scale, partial sums re-rounded to 8 bits at every hop,
so its error grows with the ranks) and agoq's trainer with its fp32 gradient all-reduce replaced
by it.

It is a baseline that the benchmarks measure, not a training option (no ``precision.gradients``
selects it), so it lives here: each local rank swaps the trainer's gradient-sync factory for the
ring before it trains a config whose ``precision.gradients`` is fp32.
"""

from __future__ import annotations

import os
import queue as queue_module
import traceback
from typing import Any

import torch
import torch.distributed as dist

from agoq.gradient.collectives import Group, parse_op, world_of
from agoq.gradient.counter import COMM_COUNTER, CommCounter, ring_all_reduce_bytes
from agoq.gradient.sync import PlainGradientSync

# A whole run of benchmarks.convergence's default length on the 4 local ranks, with room to spare.
TIMEOUT_S = 6 * 3600


# ---- the collective ------------------------------------------------------------------------------

RING_KINDS = ("int8", "fp8")


def _round_shared(x: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    """Codes of x / scale on the 8-bit grid, as uint8 bytes for the wire.

    agoq.quant derives a scale per block from the data; the FP8-LM ring instead fixes one scale
    for the whole tensor on every rank (that is what lets partial sums be added), so it rounds here.
    """
    y = x / scale
    if kind == "int8":
        return torch.round(y).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _decode_shared(codes: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    vals = codes.view(torch.int8).float() if kind == "int8" else codes.view(torch.float8_e4m3fn).float()
    return vals * scale


def ring_all_reduce_8bit(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    group: Group = None,
    *,
    kind: str = "int8",
    counter: CommCounter | None = None,
) -> None:
    """In-place FP8-LM-style ring all-reduce: one shared scale, partial sums re-rounded at each hop.

    The shared scale is W * (global absmax) / max_code, from one max all-reduce, so no partial sum
    overflows; each of the W - 1 reduce hops re-rounds, so the error grows with W. A baseline only.
    """
    if not tensor.is_floating_point():
        raise TypeError(f"ring_all_reduce_8bit expects a floating-point tensor (fp32/bf16/fp16), got {tensor.dtype}")
    if kind not in RING_KINDS:
        raise ValueError(f"ring kind must be one of {RING_KINDS}, got {kind!r}")
    op = parse_op(op)
    counter = COMM_COUNTER if counter is None else counter
    world_size, rank = world_of(group)
    n = tensor.numel()
    flat = tensor.detach().reshape(-1).float()
    amax = flat.abs().amax().reshape(1) if n else torch.zeros(1, device=flat.device)
    if world_size > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    counter.record("ring_all_reduce_8bit", 0, ring_all_reduce_bytes(4, world_size))
    max_code = 127.0 if kind == "int8" else 448.0
    scale = float(amax) * world_size / max_code
    if not 0.0 < scale < float("inf"):
        # All zeros on every rank: the sum is zero. A non-finite value anywhere: it must not come
        # out finite, so the whole result is NaN (the ring has a single scale).
        tensor.fill_(0.0 if scale == 0.0 else float("nan"))
        return
    c = -(-n // world_size)
    if c * world_size != n:
        flat = torch.nn.functional.pad(flat, (0, c * world_size - n))
    chunks = flat.view(world_size, c)
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    # Reduce-scatter ring: at hop h, send the partial sum of chunk (rank - h) and receive that of
    # chunk (rank - h - 1); every received partial is dequantized, added to the local chunk in
    # fp32 and re-rounded to 8 bits before it travels on.
    partial = _round_shared(chunks[rank], scale, kind)
    recv = torch.empty(c, dtype=torch.uint8, device=flat.device)
    for h in range(world_size - 1):
        _ring_hop(partial, recv, nxt, prv, group)
        counter.record("ring_all_reduce_8bit", c, 0, calls=0)
        idx = (rank - h - 1) % world_size
        partial = _round_shared(_decode_shared(recv, scale, kind) + chunks[idx], scale, kind)
    # Rank r now holds chunk (r + 1) mod W fully reduced; the all-gather ring only moves codes.
    out = torch.empty(world_size, c, dtype=torch.uint8, device=flat.device)
    own = (rank + 1) % world_size
    out[own] = partial
    for h in range(world_size - 1):
        _ring_hop(out[(own - h) % world_size].contiguous(), recv, nxt, prv, group)
        counter.record("ring_all_reduce_8bit", c, 0, calls=0)
        out[(own - h - 1) % world_size] = recv
    result = _decode_shared(out.reshape(-1)[:n], scale, kind)
    if op == "avg":
        result /= world_size
    tensor.copy_(result.view(tensor.shape))


def _ring_hop(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group: Group) -> None:
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=nxt),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=prv),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


# ---- the trained ablation ------------------------------------------------------------------------


class RingGradientSync(PlainGradientSync):
    """The fp32 gradient buffer of ``precision.gradients=fp32``, averaged along the 8-bit ring."""

    def all_reduce(self) -> None:
        if self.world == 1:
            return super().all_reduce()
        self.counter.reset()
        ring_all_reduce_8bit(self.buffer, "avg", self.group, counter=self.counter)
        self.wire_bytes_last_step = self.counter.bytes()


def _ring_sync(mode: str, params: list, group: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
    """The trainer's gradient sync for a config asking fp32: the same fp32 buffer, reduced along the 8-bit ring."""
    if mode != "fp32" or kwargs.get("sharded"):
        raise ValueError(f"the ring8 ablation replaces the fp32 all-reduce; got precision.gradients={mode!r} (zero1: {bool(kwargs.get('sharded'))})")
    return RingGradientSync(params, group, device, torch.float32)


def _worker(rank: int, world: int, port: int, cfg: Any, env: dict[str, str], queue: Any) -> None:
    # Forked from agoq's fork server, a worker has the server's environment: the launcher's is this one.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    import agoq.launch.components as components_module
    from agoq.launch.run import train_worker

    torch.set_num_threads(1)  # a forked child's OpenMP pool, inherited from a parent that ran one, hangs in its first matmul
    components_module.make_gradient_sync = _ring_sync
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, "ok", train_worker(cfg)))
    except BaseException:  # every failure goes to the launcher, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def train_ring8(cfg: Any, timeout_s: float = TIMEOUT_S) -> dict[str, Any] | None:
    """Train ``cfg`` (precision.gradients = fp32) on local processes with the ring all-reduce; rank 0's summary."""
    import torch.multiprocessing as mp

    from agoq.data.tokens import prepare_data
    from agoq.launch.forkserver import start_method, workers_environment
    from agoq.launch.loopback import free_port

    if cfg.precision.gradients != "fp32":
        raise ValueError(f"the ring8 ablation replaces the fp32 all-reduce; set precision.gradients=fp32, not {cfg.precision.gradients!r}")
    d = cfg.data
    # The tokenizer and token file once, here: the workers only read the cache (as `agoq train` does).
    prepare_data(d.corpus if d.corpus != "kjv" else None, d.tokenizer, d.vocab_size, d.cache_dir, d.val_fraction)
    world = cfg.world_size
    with workers_environment():
        ctx = mp.get_context(start_method())
        env = dict(os.environ)
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, env, queue)) for r in range(world)]
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    except queue_module.Empty:
        errors.append(f"no answer from ranks {sorted(set(range(world)) - set(results))} within {timeout_s:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("the ring8 run failed\n" + "\n".join(errors))
    return results.get(0)
