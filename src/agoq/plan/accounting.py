"""The byte and time formulas of one training configuration, per pipeline rank, for the baseline and AGoQ.

Every byte count here comes from the code the trainer runs or measures, not from a second copy
of a formula: saved activations per layer from :func:`agoq.activation.accounting.layer_saved_bytes` (checked
to the byte against the meter), the loss's from :func:`agoq.activation.loss.loss_saved_bytes`,
a stage's from :func:`agoq.parallel.dbca.stage_saved_bytes`, in-flight peaks from torch's own
schedule order (:func:`agoq.parallel.inflight.peak_inflight_bytes`), stage bits from the trainer's DBCA
function (:func:`agoq.parallel.dbca.stage_layer_bits`), parameter shapes from the model's own modules
(built on the meta device), and 8-bit sizes from :meth:`agoq.quant.QuantFormat.nbytes`.

Tensor parallelism with sequence parallelism (Megatron-LM's TP + SP) divides every saved tensor
of a decoder layer by ``tp``: norm inputs and GEMM inputs are sharded along the sequence, the
attention core and the SwiGLU tensors along heads / the intermediate size. The per-rank count is
therefore the layer accounting at ``seq_len / tp`` tokens per sequence, which is the same number
(a quantized tensor's bytes depend only on its element count). The remaining assumptions are in
docs/plan.md.

The formulas fall into three parts that read one set of derived sizes (:class:`PlanShape`): the
persistent state (:class:`StateBytes`: weights, gradients, optimizer state), saved activations and
pipeline buffers (:class:`ActivationBytes`) and the transient working set (:class:`TemporaryBytes`);
:class:`PlanAccounting` puts them together into a rank's bytes and adds the time estimate. The
search over bits and recompute is agoq.plan.memory's, the report agoq.plan.report's.
"""

from __future__ import annotations

import functools
from functools import cached_property

import torch

from agoq.activation.accounting import U_bytes, layer_saved_bytes
from agoq.activation.loss import default_chunk_size
from agoq.activation.ops import NORM_CHUNK_VALUES, SWIGLU_CHUNK_VALUES, chunk_rows
from agoq.activation.policy import ActivationPolicy, LayerPrecision, make_policy, with_loss_path
from agoq.gradient.collectives import reduce_piece
from agoq.gradient.layout import DEFAULT_BUCKET_BYTES, FOLD_PIECE, BucketRun, bucket_runs
from agoq.parallel.dbca import stage_layer_bits, stage_saved_bytes
from agoq.parallel.inflight import inflight_microbatches, loss_recompute_needed, loss_weight_grad_in_forward, peak_inflight_bytes
from agoq.parallel.layout import PipelineLayout
from agoq.parallel.pipeline import rank_stages
from agoq.plan.config import DTYPES, PlanConfig, Setup
from agoq.plan.result import RankMemory
from agoq.quant import QuantFormat, parse_format

from agoq.train.optim import step_group_bytes

INDEX_BYTES = 8  # int64 token ids / targets
ADAM_MOMENTS = 2
# torchao's AdamW8bit (and bitsandbytes) keep a tensor's moments in 8 bits only when it has at least
# this many values and whole blocks; smaller tensors keep fp32 moments.
OPTIM8_MIN_NUMEL = 4096
OPTIM8_QMAP_BYTES = 256 * 4  # the fp32 code book each 8-bit state tensor carries
STEP_BYTES = 4  # AdamW's per-parameter step counter (a 0-dim fp32 tensor)
# Per element of the [tokens, intermediate] tensors, what a SwiGLU backward materialises at once,
# counted from agoq.activation.ops: the baseline (autograd through silu and mul) makes the gradients
# of the product, gate and up and SiLU's derivative in the compute dtype; the fused op's backward
# (_swiglu_backward), per element of the chunk of rows it works on, at its peak holds gate and up
# dequantized to fp32, the output gradient in fp32, sigmoid, SiLU and the gate gradient's first
# product in fp32, and the up gradient as computed in the compute dtype (besides the whole gate and
# up gradients it writes the chunks into, and the whole output gradient, computed in one GEMM).
SWIGLU_BACKWARD_VALUES = {"baseline": (0, 4), "quantized": (6, 1)}  # (fp32 values, compute-dtype values)
# The paper's measured cost of its quantization kernels per layer: +2% forward, +3% backward.
QUANT_OVERHEAD = (0.02, 0.03)
BACKWARD_OVER_FORWARD = 2.0  # backward does two GEMMs per forward GEMM


def layer_backward_bytes(tokens: int, hidden: int, intermediate: int, es: int, block_size: int | None, device: torch.device) -> int:
    """The largest working set of one decoder layer's backward beside what the layer keeps: its
    SwiGLU's (autograd's, or with ``block_size`` the fused 4-bit op's) or its fused norm + gate/up's."""
    fp32_values, dtype_values = SWIGLU_BACKWARD_VALUES["baseline" if block_size is None else "quantized"]
    if block_size is None:
        return tokens * intermediate * (4 * fp32_values + es * dtype_values)
    # The fused backward works a chunk of rows at a time beside its two whole outputs and the
    # whole output gradient.
    rows = chunk_rows(tokens, intermediate, block_size, device, SWIGLU_CHUNK_VALUES)
    swiglu = rows * intermediate * (4 * fp32_values + es * dtype_values) + 3 * tokens * intermediate * es
    # Then the fused norm + gate/up backward: those two gradients, the two weight gradients it
    # returns, the recomputed norm output of every token they are GEMMs with, and the norm's fp32
    # recompute and backward (about six [rows, hidden] of the chunk of rows it works on).
    norm_rows = chunk_rows(tokens, hidden, block_size, device, NORM_CHUNK_VALUES)
    norm_gate_up = 2 * (tokens + hidden) * intermediate * es + tokens * hidden * es + 6 * norm_rows * hidden * 4
    return max(swiglu, norm_gate_up)


class PlanShape:
    """The derived sizes every formula reads, computed once from a validated PlanConfig: the model,
    the compute dtype, the pipeline layout (stages, layer ranges, each rank's stages, torch's
    schedule order and in-flight counts), and the tp-sharded token and vocabulary counts."""

    def __init__(self, cfg: PlanConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.m = cfg.model
        self.dtype = DTYPES[cfg.dtype]
        self.es = torch.empty((), dtype=self.dtype).element_size()
        self.layout = PipelineLayout(cfg.schedule, cfg.pp, cfg.microbatches, cfg.vstages, cfg.dp)
        self.key = self.layout.key
        self.num_stages = self.layout.num_stages
        self.ranges = self.layout.stage_ranges(self.m.n_layers)
        self.rank_stages = [rank_stages(self.key, r, cfg.pp, cfg.vstages) for r in range(cfg.pp)]
        self.fmt = parse_format(cfg.activation_format)
        self.device = torch.device(cfg.device)  # sizes the chunks some temporaries are cut into
        # Per-rank tokens of one micro-batch's sharded tensors: sequence parallelism cuts seq by tp.
        self.seq_tp = cfg.seq_len // cfg.tp
        self.tokens_tp = cfg.micro_batch * self.seq_tp
        self.tokens = cfg.micro_batch * cfg.seq_len
        self.vocab_tp = -(-self.m.vocab_size // cfg.tp)  # vocab-parallel embedding / head, padded to tp
        if cfg.pp == 1:
            self.order = None
            self.inflight = (1,)  # one micro-batch's forward and backward before the next (Megatron, agoq's trainer)
        else:
            self.order = self.layout.order()
            self.inflight = inflight_microbatches(self.key, cfg.pp, cfg.microbatches, cfg.vstages).per_rank

    @property
    def hidden_bytes(self) -> int:
        """One micro-batch's [tokens, hidden] tensor on one tp rank (1U / tp)."""
        return self.tokens_tp * self.m.hidden * self.es


class StateBytes:
    """What a rank keeps for the whole run: weights, gradients and optimizer state."""

    def __init__(self, shape: PlanShape) -> None:
        self.shape = shape
        self.cfg = shape.cfg

    @cached_property
    def layer_numels(self) -> list[int]:
        """Per-rank numel of each parameter tensor of one decoder layer: TP splits 2-D weights, norms are replicated."""
        from agoq.models.llama import DecoderLayer

        with torch.device("meta"):
            layer = DecoderLayer(self.shape.m, 0)
        return [p.numel() if p.ndim == 1 else p.numel() // self.cfg.tp for p in layer.parameters()]

    def rank_numels(self, rank: int) -> list[int]:
        """Per-rank numel of every parameter tensor a pp rank holds, in the trainer's registration order."""
        sh = self.shape
        m, out = sh.m, []
        for s in sh.rank_stages[rank]:
            if s == 0:
                out.append(sh.vocab_tp * m.hidden)
            out += self.layer_numels * len(sh.ranges[s])
            if s == sh.num_stages - 1:
                out.append(m.hidden)  # final norm
                # A tied head shares the embedding where one rank holds both; else the last stage keeps
                # its own copy (Megatron's shared-embedding copy, kept in sync by an all-reduce).
                if not (m.tie_embeddings and 0 in sh.rank_stages[rank]):
                    out.append(sh.vocab_tp * m.hidden)
        return out

    def buckets(self, numels: list[int]) -> list[BucketRun]:
        """The gradient buckets of a rank's parameters, run-length encoded: the layout rule of the 8-bit
        buffer and of ZeRO-1's shards, read in time bounded by the parameter count whatever their sizes."""
        return bucket_runs(numels, self.cfg.gradient_block, DEFAULT_BUCKET_BYTES // 4, self.cfg.dp)

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one accounting per plan, read by every setup and recompute count)
    def bucket_sizes(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(count, padded value count) of each run of a rank's gradient buckets."""
        return tuple((run.count, run.padded) for run in self.buckets(self.rank_numels(rank)))

    def parameter_bytes(self, numels: list[int]) -> int:
        """Model weights in the compute dtype."""
        return sum(numels) * self.shape.es

    def gradient_bytes(self, numels: list[int], setup: Setup) -> int:
        """fp32 main gradients (flat, or bucketed and padded for ZeRO-1), or the 8-bit block-wise buffer."""
        if setup.gradients:
            fmt = QuantFormat("int", 8, self.cfg.gradient_block)
            return sum(run.count * fmt.nbytes(run.padded) for run in self.buckets(numels))
        if setup.zero1:
            return 4 * sum(run.count * run.padded for run in self.buckets(numels))
        return 4 * sum(numels)

    def _moments(self, n: int, setup: Setup) -> int:
        """AdamW's two moments of n values: fp32, or 8-bit block-wise where the 8-bit optimizer quantizes."""
        if setup.optimizer and n >= OPTIM8_MIN_NUMEL and n % self.cfg.optimizer_block == 0:
            return ADAM_MOMENTS * (QuantFormat("int", 8, self.cfg.optimizer_block).nbytes(n) + OPTIM8_QMAP_BYTES)
        return ADAM_MOMENTS * 4 * n

    def optimizer_bytes(self, numels: list[int], setup: Setup) -> int:
        """AdamW moments (fp32 or 8-bit), step counters and fp32 master weights; ZeRO-1 keeps one dp shard of each bucket."""
        master = 0 if self.shape.dtype == torch.float32 else 4
        if not setup.zero1:
            return sum(master * n + self._moments(n, setup) + STEP_BYTES for n in numels)
        total = 0
        for run in self.buckets(numels):
            chunk = run.padded // self.cfg.dp
            # one step counter per (parameter, shard) piece; dp rank 0's shard
            pieces = sum(1 for sg in run.segments if sg.offset < chunk)
            total += run.count * (master * chunk + self._moments(chunk, setup) + STEP_BYTES * pieces)
        return total

    # ---- activations

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one accounting per plan; the bucket layout is costly for 70B)
    def states(self, rank: int, setup: Setup) -> tuple[list[int], tuple[int, int, int]]:
        """A rank's parameter numels and its (parameter, gradient, optimizer) bytes, which no bit width changes."""
        numels = self.rank_numels(rank)
        return numels, (self.parameter_bytes(numels), self.gradient_bytes(numels, setup), self.optimizer_bytes(numels, setup))


class ActivationBytes:
    """What a rank keeps for backward: saved activations per stage and micro-batch, the pipeline's
    buffers, the rope tables, the in-flight peaks over one step, and the DBCA stage bits."""

    def __init__(self, shape: PlanShape) -> None:
        self.shape = shape
        self.cfg = shape.cfg

    def policy(self, setup: Setup) -> ActivationPolicy:
        """The activation policy agoq's trainer builds for this configuration."""
        if not setup.activations:
            return make_policy("bf16")
        spec = self.shape.fmt.name
        recompute = loss_recompute_needed(self.cfg.pp)
        in_forward = loss_weight_grad_in_forward(self.cfg.pp, self.cfg.tp)
        return with_loss_path(make_policy("agoq", fmt=spec), recompute=recompute, weight_grad_in_forward=in_forward)

    def layer_bytes(self, policy: ActivationPolicy, bits: int) -> int:
        """What one decoder layer keeps for one micro-batch on one tp rank at ``bits``."""
        sh = self.shape
        return stage_saved_bytes(sh.m, policy, range(1), False, bits, self.cfg.micro_batch, sh.seq_tp, sh.dtype)

    @cached_property
    def final_norm_bytes(self) -> int:
        """The final RMSNorm's saved input and rstd (one of a baseline layer's two norms)."""
        sh = self.shape
        c = sh.m
        kinds = layer_saved_bytes(
            self.cfg.micro_batch, sh.seq_tp, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate, sh.dtype, LayerPrecision()
        )
        return kinds["norm_input"] // 2

    def stage_bytes(self, stage: int, policy: ActivationPolicy, bits: int, recompute: int) -> tuple[int, int]:
        """(saved for backward, pipeline buffers) of one in-flight micro-batch on a stage."""
        sh = self.shape
        layers = sh.ranges[stage]
        last = stage == sh.num_stages - 1
        saved = stage_saved_bytes(sh.m, policy, layers, last, bits, self.cfg.micro_batch, sh.seq_tp, sh.dtype, tp=self.cfg.tp)
        k = min(recompute, len(layers))
        if k:
            # A recomputed layer keeps only its input (Megatron's block recomputation).
            saved -= k * (self.layer_bytes(policy, bits) - sh.hidden_bytes)
        if stage == 0:
            saved += sh.tokens * INDEX_BYTES  # the embedding keeps the token ids
            if self.cfg.tp > 1:
                saved += sh.tokens * sh.es  # and, vocab-parallel, which ids are this rank's
        if last:
            saved += self.final_norm_bytes
        buffers = 0
        quantized_input = policy.layer(0).norm_input is not None and bits < 16
        if stage > 0 and quantized_input:
            buffers += sh.hidden_bytes  # the received input, which the first layer no longer keeps itself
        if not last and self.cfg.pp > 1:
            buffers += sh.hidden_bytes  # torch.distributed.pipelining keeps each stage output until its backward
        return saved, buffers

    def rope_bytes(self, rank: int) -> int:
        """The fp32 cos/sin tables every stage module keeps once, shared by its layers and micro-batches."""
        return len(self.shape.rank_stages[rank]) * 2 * self.cfg.seq_len * self.shape.m.head_dim * 4

    def peaks(self, weights: list[int]) -> list[int]:
        """Each rank's peak over one step of in-flight bytes, stage s weighing weights[s] per micro-batch."""
        if self.shape.order is None:
            return [sum(weights)]
        return peak_inflight_bytes(self.shape.order, weights)

    def dbca_bits(self, policy: ActivationPolicy) -> list[int]:
        """Per-stage bits from the trainer's DBCA function (uniform base bits at pp = 1, as the trainer does)."""
        sh = self.shape
        if self.cfg.pp == 1 or self.cfg.stage_bits == "uniform":
            return [sh.fmt.bits] * sh.num_stages
        layer_bits = stage_layer_bits(
            sh.m,
            sh.layout,
            self.cfg.micro_batch,
            sh.seq_tp,
            policy,
            sh.fmt.bits,
            dtype=sh.dtype,
            tp=self.cfg.tp,
        )
        return [layer_bits[r.start] for r in sh.ranges]

    @cached_property
    def layer_units(self) -> dict[str, float]:
        """Saved bytes of one decoder layer in U (batch x seq x hidden x 2 bytes), without tp: baseline and 4-bit."""
        sh = self.shape
        unit = U_bytes(self.cfg.micro_batch, self.cfg.seq_len, sh.m.hidden)
        out = {}
        for name, setup in (("baseline", Setup()), ("A", Setup(activations=True))):
            p = self.policy(setup)
            b = stage_saved_bytes(sh.m, p, range(1), False, sh.fmt.bits, self.cfg.micro_batch, self.cfg.seq_len, sh.dtype)
            out[name] = round(b / unit, 4)
        return out


class TemporaryBytes:
    """Estimates of a rank's largest transient working set, the worst of its step's three phases:
    forward and backward, the gradient reduction, and the optimizer step."""

    def __init__(self, shape: PlanShape, states: StateBytes, activations: ActivationBytes) -> None:
        self.shape = shape
        self.cfg = shape.cfg
        self.states = states
        self.activations = activations

    def _compute_work_bytes(self, rank: int, setup: Setup, bits: list[int], recompute: int, policy: ActivationPolicy) -> int:
        """The largest working set of a rank's forward and backward compute: a layer's fused backward
        (plus the recomputed layer's activations) or, on the last stage, the loss's."""
        sh = self.shape
        m, es = sh.m, sh.es
        swiglu = layer_backward_bytes(sh.tokens_tp, m.hidden, m.intermediate, es, sh.fmt.block_size if setup.activations else None, sh.device)
        worst = 0
        for s, b in zip(sh.rank_stages[rank], bits):
            layer = swiglu
            if recompute and len(sh.ranges[s]):
                layer += self.activations.layer_bytes(policy, b)  # the recomputed layer's activations, during its backward
            worst = max(worst, layer)
            if s == sh.num_stages - 1:
                if policy.fused_loss:
                    rows = min(sh.tokens, default_chunk_size(sh.vocab_tp, m.hidden))
                    loss = rows * sh.vocab_tp * (4 + 2 * es)  # a chunk's logits, fp32 log-probs and gradient
                else:
                    loss = sh.tokens * sh.vocab_tp * (4 + es)  # fp32 gradient of the log-softmax and its cast
                worst = max(worst, loss)
        return worst

    def temporary_bytes(self, rank: int, numels: list[int], setup: Setup, bits: list[int], recompute: int, policy: ActivationPolicy) -> int:
        """The largest transient working set of a rank: the worst of its step's three phases.

        The trainer counts the same three (agoq.train.saved.StepAllocations): forward and backward,
        the gradient reduction, and the optimizer step; tests/test_plan_train.py checks this bound
        against its measurements.
        """
        es, dp = self.shape.es, self.cfg.dp
        worst = self._compute_work_bytes(rank, setup, bits, recompute, policy)
        p2p = 2 * self.shape.hidden_bytes if self.cfg.pp > 1 else 0  # send and receive buffers
        largest = max(numels)
        # Backward: autograd's full-precision gradient of the largest tensor before it is folded into
        # the gradient buffer. Into 8 bits (a piece at a time) that happens once the op that made it
        # (the embedding's or the output head's backward) has returned, its work done: the fused
        # layers return their weight gradients inside their work (worst). The baseline's autograd
        # backward measures as holding it besides a layer's or the loss's work (tests/test_plan_train.py).
        if setup.gradients:
            # A piece being folded: the stored values dequantized, the sum, and the quantizer's work.
            folding = max(largest * es, worst) + 3 * 4 * min(FOLD_PIECE, largest)
        else:
            folding = largest * es + worst
        reduction = optimizer = 0
        fmt8 = QuantFormat("int", 8, self.cfg.gradient_block)
        runs = self.states.bucket_sizes(rank)
        n_buckets = sum(count for count, _ in runs)
        bucket = max(n for _, n in runs)
        chunk = bucket // dp
        in_flight = 0
        if setup.gradients and dp > 1:
            # A bucket's storage is sent as it is and gathered into (agoq.gradient.bucket): one
            # bucket's received rows, and on a CPU, where a rank has more than one bucket, the
            # previous bucket's, which carry its all-gather row sent to every rank until that
            # gather completes (see gathers_by_all_to_all); a GPU gathers in place.
            in_flight = min(n_buckets, 2 if self.shape.device.type == "cpu" else 1) * fmt8.nbytes(bucket)
            # One bucket reduced a piece at a time into its own row of the storage: one piece summed
            # in fp32 and requantized (the fp32 values and integer codes the quantizer works on),
            # beside the buckets in flight. A ZeRO-1 reduce-scatter keeps its fp32 shards (below).
            reduction = in_flight + 9 * min(reduce_piece(self.shape.device), chunk)
        # A bucket is sent once the gradient that completed it is folded and dropped, so the buckets
        # in flight and the full-precision gradient being folded are not held at once; a rank's
        # only bucket is sent after its last layer's backward, others during a later layer's.
        beside = worst if n_buckets > 1 else 0
        backward = p2p + max(folding, in_flight + beside)
        if setup.zero1:
            # Every bucket's fp32 shard of the reduced gradient waits for the optimizer step, which
            # then all-gathers one bucket's updated weights in the compute dtype.
            shards = 4 * sum(count * (n // dp) for count, n in runs)
            reduction = max(reduction, shards)
            optimizer = shards + es * (bucket + chunk)
        elif setup.gradients:
            # Gradients read back from 8 bits in fp32 for one group of parameters, at most
            # step_group_bytes: fused AdamW steps a larger tensor a slice at a time
            # (MasterWeightOptimizer.step_slices), the 8-bit AdamW steps it whole.
            group = step_group_bytes(self.shape.device, sum(self.states.layer_numels))
            optimizer = max(group, 4 * largest) if setup.optimizer else group
        if setup.optimizer:
            optimizer += ADAM_MOMENTS * 4 * largest  # one tensor's moments dequantized for its update
        return max(backward, reduction, optimizer)


class PlanAccounting:
    """One configuration's bytes and time per rank: its persistent state, saved activations and
    temporaries put together into a :class:`RankMemory`, and the iteration-time estimate (the
    search over bits and recompute is agoq.plan.memory's, the report agoq.plan.report's)."""

    def __init__(self, cfg: PlanConfig) -> None:
        self.cfg = cfg
        self.shape = PlanShape(cfg)  # validates cfg
        self.states = StateBytes(self.shape)
        self.activations = ActivationBytes(self.shape)
        self.temporaries = TemporaryBytes(self.shape, self.states, self.activations)

    def policy(self, setup: Setup) -> ActivationPolicy:
        """The activation policy agoq's trainer builds for this configuration."""
        return self.activations.policy(setup)

    def optimizer_bytes(self, numels: list[int], setup: Setup) -> int:
        """AdamW moments (fp32 or 8-bit), step counters and fp32 master weights (:meth:`StateBytes.optimizer_bytes`)."""
        return self.states.optimizer_bytes(numels, setup)

    def rank_memory(self, rank: int, setup: Setup, policy: ActivationPolicy, stage_bits: list[int], recompute: int) -> RankMemory:
        """One rank's bytes with the given per-stage bits and recompute count."""
        sh, acts = self.shape, self.activations
        numels, (params, grads, optim) = self.states.states(rank, setup)
        saved, buffers = zip(*(acts.stage_bytes(s, policy, stage_bits[s], recompute) for s in range(sh.num_stages)))
        saved_peak = acts.peaks(list(saved))[rank] + acts.rope_bytes(rank)
        both_peak = acts.peaks([a + b for a, b in zip(saved, buffers)])[rank] + acts.rope_bytes(rank)
        mine = sh.rank_stages[rank]
        rm = RankMemory(
            pp_rank=rank,
            stages=tuple(mine),
            layers=sum(len(sh.ranges[s]) for s in mine),
            bits=tuple(stage_bits[s] for s in mine) if setup.activations else None,
            inflight=sh.inflight[rank],
            recompute_layers=recompute,
            parameters=params,
            gradients=grads,
            optimizer=optim,
            activations_per_microbatch=sum(saved[s] for s in mine),
            activations_peak=saved_peak,
            pipeline_buffers=both_peak - saved_peak,
            temporary=self.temporaries.temporary_bytes(rank, numels, setup, [stage_bits[s] for s in mine], recompute, policy),
            total_without_recompute=0,
        )
        return rm

    def rank_time(self, rank: int, setup: Setup, recompute: int, policy: ActivationPolicy, bits: list[int] | None = None) -> float:
        """Forward-equivalent work of one micro-batch on a rank, in units of one token's GEMM FLOPs (an estimate)."""
        sh = self.shape
        m = sh.m
        per_layer_params = sum(self.states.layer_numels) * self.cfg.tp
        layer = 2 * per_layer_params + 2 * self.cfg.seq_len * m.hidden  # GEMMs + causal attention, per token
        head = 2 * m.vocab_size * m.hidden
        fwd_bwd = 1 + BACKWARD_OVER_FORWARD
        total = 0.0
        for s in sh.rank_stages[rank]:
            quantized = setup.activations and (bits is None or bits[s] < 16)
            quant = (QUANT_OVERHEAD[0] + BACKWARD_OVER_FORWARD * QUANT_OVERHEAD[1]) if quantized else 0.0
            n = len(sh.ranges[s])
            total += n * layer * (fwd_bwd + quant) + min(recompute, n) * layer
            if s == sh.num_stages - 1:
                recomputes = policy.fused_loss and policy._loss_recompute and not policy._loss_weight_grad_in_forward
                total += head * fwd_bwd + (head if recomputes else 0)
        return total
