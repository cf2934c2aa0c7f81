"""Scaling the course's :class:`DecoderOnlyLM` out over several processes with PyTorch's own
engines: data parallelism (``DistributedDataParallel``), fully sharded data parallelism
(FSDP2's ``fully_shard``), tensor parallelism (``DTensor`` and ``parallelize_module``,
Megatron-style) and pipeline parallelism (``torch.distributed.pipelining``).

Nothing here moves data between processes by itself: the plans (:func:`apply_ddp`,
:func:`apply_fsdp`, :func:`apply_tensor_parallel`, :func:`build_pipeline`) tell PyTorch's
engines how to split the model, and the engines communicate. Beside the plans:

* :class:`CommCounter` counts the bytes a process hands to collectives and sends, where every
  engine's traffic passes: PyTorch's dispatcher;
* the formulas the measurements are checked against: parameters, gradients and optimiser
  states per rank (:func:`rank_parameters`, :func:`expected_memory`), bytes per step
  (:func:`expected_traffic`), the pipeline bubble (:func:`bubble_fraction`);
* :func:`held_bytes`, :func:`full_weights`, :func:`full_gradients`, :func:`pipeline_timeline`
  measure a rank.

``tutorial_lib.parallel_runs`` runs all of this in several processes (notebook 10, the tests).

Tensor parallelism and the fused projection: the course's attention computes Q, K and V with
one ``nn.Linear`` whose rows are [Q; K; V]. A column split of that matrix into N contiguous
parts would give rank 0 all of Q and part of K. :func:`apply_tensor_parallel` first reorders
the rows to [Q_0; K_0; V_0; Q_1; K_1; V_1; ...] (Q_r, K_r, V_r: the rows of the heads rank r
computes, :func:`qkv_rows_by_rank`), so that the contiguous split gives every rank whole heads
of each; :func:`full_weights` puts them back. The function the model computes does not change.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from .checks import check_count
from .config import ModelConfig
from .gpt import DecoderOnlyLM
from .layers import position_bias
from .params import block_parameters, expected_parameters, training_bytes

SCHEMES = ("ddp", "fsdp", "tp", "pp", "fsdp_tp")
TP_2D = 2  # fsdp_tp: tensor parallelism within pairs of ranks, FSDP across the N / 2 pairs (a 2-D mesh)
SCHEDULES = ("gpipe", "1f1b")


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The loss ``DecoderOnlyLM`` computes: cross-entropy averaged over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---- what each scheme divides: counts from the config ----------------------------------------


def check_tensor_parallel(cfg: ModelConfig, degree: int, vocab_parallel: bool = True) -> None:
    """Raise ValueError unless every count tensor parallelism splits divides by ``degree``."""
    check_count("degree", degree, why="the tensor-parallel degree")
    counts = [("query heads", "n_heads", cfg.n_heads), ("key/value heads", "n_kv_heads", cfg.kv_heads),
              ("FFN columns", "d_ff", cfg.ffn_dim)]
    if vocab_parallel:
        counts.append(("embedding and head rows", "vocab_size", cfg.vocab_size))
    for what, name, count in counts:
        if count % degree:
            raise ValueError(f"tensor parallelism over {degree} ranks splits the {what}, but {name}={count} "
                             f"does not divide by {degree}")


def check_dense(cfg: ModelConfig, plan: str) -> None:
    """Raise ValueError for the parts that the tensor-parallel and pipeline plans do not split:
    a mixture of experts (its experts would need expert parallelism, not built here) and T5's
    relative-position table, one (buckets x heads) table shared by every layer (a pipeline
    would need a copy on every stage, tensor parallelism a split by heads)."""
    if cfg.n_experts:
        raise ValueError(f"the {plan} plan splits dense models; this config has a mixture of "
                         f"n_experts={cfg.n_experts} experts")
    if cfg.positions == "relative":
        raise ValueError(f"the {plan} plan does not split T5's relative-position table (positions='relative'); "
                         "use learned, sinusoidal, rope, alibi or none")


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """The layers of each pipeline stage: consecutive, as equal as possible, the earlier stages
    taking one more when they do not divide evenly."""
    check_count("stages", stages, maximum=n_layers, bound_name="n_layers")
    size, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def rank_parameters(cfg: ModelConfig, scheme: str, world_size: int, rank: int = 0, *,
                    vocab_parallel: bool = True) -> float:
    """How many of the model's parameters rank ``rank`` holds, from the config alone.

    ddp: all of them. fsdp: 1/N of every parameter (exactly P / N when every first dimension
    divides by N; FSDP pads the others). tp: the split matrices' 1/N (Q, K, V and the FFN's up
    and gate by output rows, the output projection and the FFN's down matrix by input columns,
    the embedding and head by vocabulary when asked) plus whole copies of the rest: norms, the
    position table, and the biases of the row-parallel matrices, which are added once after
    the sum. pp: the stage's layers, the embeddings on the first stage, the final norm and the
    head on the last (a tied head is a second copy of the token table there). fsdp_tp: the 2-D
    mesh of :func:`two_d_mesh`, tensor parallelism's share over ``TP_2D`` ranks, sharded again
    by FSDP across the N / ``TP_2D`` pairs.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "fsdp_tp":
        return rank_parameters(cfg, "tp", TP_2D, vocab_parallel=vocab_parallel) / tp_pairs(world_size)
    counts = expected_parameters(cfg)
    total, L = counts["total"], cfg.n_layers
    if scheme == "ddp":
        return total
    if scheme == "fsdp":
        return total / world_size
    if scheme == "tp":
        check_tensor_parallel(cfg, world_size, vocab_parallel)
        split = _split_in_blocks(cfg, counts)
        if vocab_parallel:
            split += counts["embed.tokens"] + counts["head"]  # head: 0 when tied (it is the table)
        return total - split + split // world_size
    layers = stage_layers(L, world_size)[rank]
    held = len(layers) * block_parameters(cfg)["total"]
    if rank == 0:
        held += counts["embed.tokens"] + counts["embed.positions"]
    if rank == world_size - 1:
        tied_copy = counts["embed.tokens"] if cfg.tie_embeddings and world_size > 1 else 0
        held += counts["decoder.final_norm"] + counts["head"] + tied_copy
    return held


def _split_in_blocks(cfg: ModelConfig, counts: dict[str, int]) -> int:
    """The blocks' parameters that tensor parallelism splits: Q, K, V, the output projection and
    the FFN's matrices, less the row-parallel matrices' biases (kept whole)."""
    split = sum(counts[f"decoder.{k}"] for k in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.up", "ffn.gate",
                                                 "ffn.down"))
    return split - cfg.n_layers * cfg.d_model * (cfg.uses_bias("out") + cfg.uses_bias("ffn"))


def expected_memory(cfg: ModelConfig, scheme: str, world_size: int, rank: int = 0, *,
                    vocab_parallel: bool = True) -> dict[str, float]:
    """Bytes of weights, gradients and AdamW's two moments on one rank, float32 throughout:
    ``tutorial_lib.params.training_bytes`` of the whole model divided by N (fsdp), or of the
    parameters the rank holds (:func:`rank_parameters`)."""
    if scheme == "fsdp":
        held, share = expected_parameters(cfg)["total"], 1 / world_size
    elif scheme == "fsdp_tp":  # fsdp's 1/G of what tp leaves the rank
        held, share = rank_parameters(cfg, "tp", TP_2D, vocab_parallel=vocab_parallel), 1 / tp_pairs(world_size)
    else:
        held, share = rank_parameters(cfg, scheme, world_size, rank, vocab_parallel=vocab_parallel), 1
    parts = training_bytes(held, "fp32")
    return {k: parts[k] * share for k in ("weights", "gradients", "optimizer_states")}


def expected_traffic(cfg: ModelConfig, scheme: str, world_size: int, rank: int = 0, *, batch: int,
                     seq_len: int, vocab_parallel: bool = True, bytes_per_value: int = 4) -> dict[str, float]:
    """The bytes one rank hands to each kind of collective in one training step (its payload:
    the tensor it contributes), from the config and the global batch of ``batch`` sequences.

    ddp: one all-reduce of every gradient. fsdp_tp (N / ``TP_2D`` tensor-parallel pairs): tp's
    all-reduces within the rank's pair, for the pair's share of the batch, and fsdp's
    all-gathers and reduce-scatters across the pairs, of the piece tp leaves the rank. fsdp: an
    all-gather of every parameter before the forward pass, again of each block's before its
    backward pass (blocks free their gathered weights after the forward pass; the outermost
    module keeps its own until backward), each rank contributing its 1/N; a reduce-scatter of
    every gradient. tp: per block two all-reduces of the (B, T, d) activations forward (after
    attention's output projection and after the FFN's down matrix) and two backward (the
    gradients of the two sublayers' inputs), plus, when the vocabulary is split, one forward
    after the embedding lookup, one backward at the head's input, and three of B * T values for
    the loss (the maximum logit, the sum of exponentials and the target's log-probability). pp:
    at every stage boundary the (B/M, T, d) activations go forward and their gradients come
    back, for each of M micro-batches; with a tied head the first and the last stage also
    all-reduce the token table's gradient (:func:`sync_tied_embedding`).
    """
    b, d, L = bytes_per_value, cfg.d_model, cfg.n_layers
    activations = batch * seq_len * d * b  # (B, T, d)
    total = expected_parameters(cfg)["total"]
    if scheme == "ddp":
        return {"all_reduce": total * b}
    if scheme == "fsdp_tp":
        groups = tp_pairs(world_size)
        traffic = expected_traffic(cfg, "tp", TP_2D, batch=batch // groups, seq_len=seq_len,
                                   vocab_parallel=vocab_parallel, bytes_per_value=b)
        held = rank_parameters(cfg, "tp", TP_2D, vocab_parallel=vocab_parallel)
        split = _split_in_blocks(cfg, expected_parameters(cfg))
        in_blocks = L * block_parameters(cfg)["total"] - split + split // TP_2D  # the pair's share of the blocks
        return {**traffic, "all_gather": (held + in_blocks) * b / groups, "reduce_scatter": held * b}
    if scheme == "fsdp":
        in_blocks = L * block_parameters(cfg)["total"]
        return {"all_gather": (total + in_blocks) * b / world_size, "reduce_scatter": total * b}
    if scheme == "tp":
        per_step = 4 * L * activations
        if vocab_parallel:
            per_step += 2 * activations + 3 * batch * seq_len * b
        return {"all_reduce": per_step}
    if scheme != "pp":
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    traffic = {"send": activations * ((rank < world_size - 1) + (rank > 0))}
    if cfg.tie_embeddings and world_size > 1 and rank in (0, world_size - 1):
        traffic["all_reduce"] = cfg.vocab_size * d * b
    return traffic


def ring_bytes_sent(kind: str, payload: float, world_size: int) -> float:
    """What a rank sends for a collective with a bandwidth-optimal (ring) algorithm, given its
    payload: an all-reduce 2 (N - 1) / N of its tensor (a reduce-scatter, then an all-gather of
    the reduced pieces), an all-gather its piece to N - 1 others, a reduce-scatter (N - 1) / N
    of its tensor; a send is what it sends."""
    N = world_size
    factors = {"all_reduce": 2 * (N - 1) / N, "all_gather": N - 1, "reduce_scatter": (N - 1) / N, "send": 1.0}
    if kind not in factors:
        raise ValueError(f"kind must be one of {sorted(factors)}, got {kind!r}")
    return payload * factors[kind]


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The share of a pipeline step a stage waits, when every stage takes the same time per
    micro-batch and sending costs nothing: (S - 1) / (M + S - 1) for GPipe and 1F1B, the step
    being M + S - 1 micro-batch slots of which each stage works M. Huang et al. (2019, GPipe)
    give the bubble overhead as O((K - 1) / (M + K - 1)); Narayanan et al. (2021, SC21) measure
    it against the compute instead of the whole step, (p - 1) / m.

    ``chunks`` = v > 1: interleaved 1F1B (Narayanan et al., 2021, section 2.2.2), where each rank
    holds v chunks of layers (rank r the chunks r, r + S, ...): the fill and the drain take
    slots v times shorter, so the bubble is (S - 1) / (v M + S - 1), for v times as many sends.
    Zero-bubble schedules (Qi et al., 2024) fill it further and are not counted here."""
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        check_count(name, value)
    return (stages - 1) / (chunks * microbatches + stages - 1)


# ---- counting what is sent ---------------------------------------------------------------------

# dispatcher op -> (kind, index of the argument holding what this rank contributes)
_COLLECTIVES = {
    ("c10d", "allreduce_"): ("all_reduce", 0), ("c10d", "allreduce_coalesced_"): ("all_reduce", 0),
    ("c10d", "_allgather_base_"): ("all_gather", 1), ("c10d", "allgather_"): ("all_gather", 1),
    ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", 1),
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1), ("c10d", "reduce_scatter_"): ("reduce_scatter", 1),
    ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", 1),
    ("c10d", "broadcast_"): ("broadcast", 0), ("c10d", "send"): ("send", 0), ("c10d", "recv_"): ("recv", 0),
    ("c10d", "alltoall_base_"): ("all_to_all", 1), ("c10d", "barrier"): ("barrier", None),
    ("_c10d_functional", "all_reduce"): ("all_reduce", 0), ("_c10d_functional", "all_reduce_"): ("all_reduce", 0),
    ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", 0),
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", 0),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", 0),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 0),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", 0),
    ("_c10d_functional", "broadcast"): ("broadcast", 0), ("_c10d_functional", "all_to_all_single"): ("all_to_all", 0),
}
_NOT_COMMUNICATION = {"wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(x) -> int:
    if isinstance(x, Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Counts, by kind, the collectives and point-to-point messages this process starts while
    the context is open, and the bytes it hands to each (its payload: the tensor it reduces or
    sends, its own piece of an all-gather).

    Every engine's traffic passes PyTorch's dispatcher as an op of the ``c10d`` namespace
    (``dist.all_reduce``, DDP's gradient buckets, FSDP's all-gathers and reduce-scatters,
    pipeline sends) or of ``_c10d_functional`` (DTensor's redistributions), where a dispatch
    mode sees it, in the forward and in the backward pass. An op in those namespaces that is
    not a known collective is counted under ``"other: <name>"``, so that nothing goes unseen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into plain ops and collectives first
        name = func._overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and name not in _NOT_COMMUNICATION:
            kind, index = _COLLECTIVES.get((func.namespace, name), (f"other: {name}", 0))
            self.calls[kind] += 1
            self.bytes[kind] += 0 if index is None else _nbytes(args[index])
        return func(*args, **kwargs)

    def summary(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


# ---- the plans -------------------------------------------------------------------------------------


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Every rank keeps the whole model; backward() all-reduces the gradients (in buckets) and
    divides them by N. ``broadcast_buffers=False``: the buffers (RoPE's tables) are constants,
    the same on every rank; ``gradient_as_bucket_view``: the gradients live in DDP's buckets
    instead of in a second copy."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   broadcast_buffers=False, gradient_as_bucket_view=True)


def apply_fsdp(model: DecoderOnlyLM, mesh) -> DecoderOnlyLM:
    """FSDP2: every block is one unit of sharding, the rest (embeddings, final norm, head) the
    outermost one. Each rank keeps 1/N of every parameter, gradient and optimiser state;
    before a unit computes, its parameters are all-gathered, and after its backward its
    gradients are reduce-scattered."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tp_pairs(world_size: int) -> int:
    """fsdp_tp: how many tensor-parallel pairs N ranks make (the model replicas FSDP shards
    across). Raises ValueError unless N is a multiple of ``TP_2D`` with at least two pairs."""
    if world_size < 2 * TP_2D or world_size % TP_2D:
        raise ValueError(f"fsdp_tp puts tensor parallelism over {TP_2D} ranks and FSDP across the pairs: it needs "
                         f"a multiple of {TP_2D} ranks, at least {2 * TP_2D}, got {world_size}")
    return world_size // TP_2D


def two_d_mesh(device_type: str, world_size: int):
    """The 2-D device mesh (``"dp"``, ``"tp"``) of shape (N / ``TP_2D``, ``TP_2D``): ranks 2g and
    2g + 1 are pair g (``mesh["tp"]``); the ranks with the same place in their pairs share
    ``mesh["dp"]``, over which FSDP shards."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (tp_pairs(world_size), TP_2D), mesh_dim_names=("dp", "tp"))


def apply_fsdp_tp(model: DecoderOnlyLM, mesh, *, vocab_parallel: bool = True) -> DecoderOnlyLM:
    """2-D parallelism: tensor parallelism over ``mesh["tp"]`` first (:func:`apply_tensor_parallel`),
    then FSDP over ``mesh["dp"]`` (:func:`apply_fsdp`), which shards every rank's tensor-parallel
    piece again by its first dimension. Within a node, tensor parallelism's per-layer
    all-reduces take the fast links; across nodes, FSDP's all-gathers and reduce-scatters,
    which can overlap the compute, take the slower network."""
    apply_tensor_parallel(model, mesh["tp"], vocab_parallel=vocab_parallel)
    return apply_fsdp(model, mesh["dp"])


def qkv_rows_by_rank(n_heads: int, n_kv_heads: int, head_dim: int, degree: int) -> Tensor:
    """The rows of a fused [Q; K; V] weight in the order [Q_0; K_0; V_0; Q_1; K_1; V_1; ...],
    where Q_r, K_r and V_r are the rows of rank r's heads: Q's heads r * h/N .. (r+1) * h/N - 1,
    and likewise K's and V's n_kv_heads. Split into N equal contiguous parts, part r is rank
    r's rows (``order[r * n : (r + 1) * n]``, n = rows / N). With grouped-query attention,
    rank r's query heads use exactly rank r's key/value heads (query head i reads key/value
    head i // (h / h_kv))."""
    for name, count in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if count % degree:
            raise ValueError(f"tensor parallelism over {degree} ranks splits the heads, but {name}={count} "
                             f"does not divide by {degree}")
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    parts = torch.arange(q + 2 * kv).split([q, kv, kv])  # the rows of Q, of K, of V
    return torch.cat([torch.cat([rows.chunk(degree)[r] for rows in parts]) for r in range(degree)])


def apply_tensor_parallel(model: DecoderOnlyLM, mesh, *, vocab_parallel: bool = True) -> DecoderOnlyLM:
    """Megatron-style tensor parallelism (Shoeybi et al., 2019, section 3) over the ranks of
    ``mesh``, with DTensor.

    Attention splits by heads: the fused Q/K/V projection column-parallel, its rows first put
    in the order of :func:`qkv_rows_by_rank` so that each rank gets whole heads of Q, K and V;
    the output projection row-parallel (each rank multiplies its heads' part, an all-reduce
    sums). The FFN's up and gate matrices column-parallel, its down matrix row-parallel. With
    ``vocab_parallel`` the embedding and the head are split by vocabulary rows; the loss must
    then be computed under ``torch.distributed.tensor.parallel.loss_parallel()``. Each
    attention module is told how many heads it computes locally. Raises ValueError when a
    count does not divide by the degree.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    degree = mesh.size()
    check_dense(model.cfg, "tensor-parallel")
    check_tensor_parallel(model.cfg, degree, vocab_parallel)
    for block in model.blocks:
        attn = block.attn
        order = qkv_rows_by_rank(attn.n_heads, attn.n_kv_heads, attn.head_dim, degree)
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.weight[order])
            if attn.qkv.bias is not None:
                attn.qkv.bias.copy_(attn.qkv.bias[order])
        plan = {"attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(),
                # up and gate read the same input: make it one DTensor, so that the backward
                # pass sums their two input gradients before one all-reduce, not after two
                "ffn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                "ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel()}
        if block.ffn.gate is not None:
            plan["ffn.gate"] = ColwiseParallel()
        parallelize_module(block, mesh, plan)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // degree, attn.n_kv_heads // degree  # local heads
        attn.q_size, attn.kv_size = attn.q_size // degree, attn.kv_size // degree
    if vocab_parallel:
        parallelize_module(model, mesh, {
            "embed.tokens": RowwiseParallel(input_layouts=Replicate()),  # each rank looks up its rows, then sum
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # logits stay split
        })
        if model.cfg.tie_embeddings:  # both split the same matrix by rows: one parameter again
            model.head.weight = model.embed.tokens.weight
        # DTensor computes the lookup's gradient for the whole table on every rank (the same on
        # each); keep this rank's rows, like the table itself (a slice: nothing is sent)
        model.embed.tokens.weight.register_hook(lambda grad: grad.redistribute(placements=[Shard(0)]))
    return model


class PipelineStageModule(nn.Module):
    """One pipeline stage of a DecoderOnlyLM: the layers :func:`stage_layers` gives it, the
    embeddings on the first stage, the final norm and the head on the last. Its parameters keep
    the names they have in the whole model (the blocks sit in a ModuleDict under their index)."""

    def __init__(self, model: DecoderOnlyLM, stage: int, stages: int):
        super().__init__()
        check_dense(model.cfg, "pipeline")
        self.cfg = model.cfg
        self.embed = model.embed if stage == 0 else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in stage_layers(model.cfg.n_layers, stages)[stage]})
        last = stage == stages - 1
        self.final_norm = model.final_norm if last else None
        self.head = model.head if last else None

    def forward(self, x: Tensor) -> Tensor:  # first stage: ids (B, T); the others: (B, T, d)
        if self.embed is not None:
            x = self.embed(x)  # (B, T, d)
        bias = position_bias(self.cfg, x.size(1), x.size(1), x.device)  # ALiBi only
        for block in self.blocks.values():
            x = block(x, is_causal=True, bias=bias).x
        if self.head is not None:
            x = self.head(self.final_norm(x))  # (B, T, V)
        return x


def build_pipeline(model: DecoderOnlyLM, stage: int, stages: int, microbatches: int, schedule: str,
                   device: torch.device):
    """This rank's stage module, its ``PipelineStage`` and the schedule (GPipe or 1F1B) that
    runs ``microbatches`` micro-batches through it per step with :func:`lm_loss`; the schedule
    averages the micro-batches' gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    check_dense(model.cfg, "pipeline")
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages, got {microbatches} for {stages}")
    module = PipelineStageModule(model, stage, stages).to(device)
    pipeline_stage = PipelineStage(module, stage, stages, device)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return module, pipeline_stage, kind(pipeline_stage, n_microbatches=microbatches, loss_fn=lm_loss)


def sync_tied_embedding(module: PipelineStageModule, group, reduce: str = "sum") -> None:
    """A tied model uses one matrix twice: as the token table on the first stage and as the head
    on the last, so each of the two keeps a copy. The matrix's gradient is the sum of both
    uses' gradients: summing the copies' gradients over the two stages gives both the same
    gradient, and the same update keeps them equal (Megatron-LM does the same).

    ``reduce="mean"`` averages them instead, the data-parallel habit and here a mistake: the two
    copies are two uses of one matrix, not two replicas, and their mean is half the gradient.
    It exists so that the tests and notebook 10 can show that the equality check catches it."""
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
    weight = module.embed.tokens.weight if module.embed is not None else module.head.weight
    dist.all_reduce(weight.grad, group=group)
    if reduce == "mean":
        weight.grad /= dist.get_world_size(group)


# ---- measuring on a rank ---------------------------------------------------------------------------


def local_tensor(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes this rank holds of weights, gradients and AdamW's two moments (exp_avg,
    exp_avg_sq), counting only its local piece of a sharded tensor. AdamW's step counters (one
    number per tensor) are left out."""
    params = list(module.parameters())
    size = lambda t: local_tensor(t).numel() * t.element_size()
    moments = [v for p in params for k, v in optimizer.state[p].items() if k in ("exp_avg", "exp_avg_sq")]
    return {"weights": sum(size(p) for p in params),
            "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer_states": sum(size(v) for v in moments)}


def full_weights(scheme: str, module: nn.Module) -> dict[str, Tensor]:
    """Every parameter whole, under its name in the whole model, on the CPU (a collective for
    fsdp, tp and pp: every rank must call it). Tensor parallelism's Q/K/V rows are put back in
    the [Q; K; V] order. A pipeline of a tied model returns the last stage's copy of the token
    table too, as "head.weight" (the whole model lists the tied matrix once)."""
    return _gather_whole(scheme, module, lambda p: p)


def full_gradients(scheme: str, module: nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient whole, as :func:`full_weights` gathers the weights: the
    gradient each scheme leaves for the optimiser (DDP's averaged one; for fsdp the
    reduce-scattered shards put together). Parameters without a gradient are left out."""
    return _gather_whole(scheme, module, lambda p: p.grad)


def _gather_whole(scheme: str, module: nn.Module, pick) -> dict[str, Tensor]:
    named = module.module.named_parameters() if scheme == "ddp" else module.named_parameters()
    mine = {n: pick(p) for n, p in named if pick(p) is not None}
    if scheme == "ddp":
        return {n: t.detach().cpu().clone() for n, t in mine.items()}
    if scheme in ("fsdp", "tp", "fsdp_tp"):
        full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu() for n, t in mine.items()}
        if scheme in ("tp", "fsdp_tp"):
            cfg = module.cfg
            degree = dist.get_world_size() if scheme == "tp" else TP_2D
            order = qkv_rows_by_rank(cfg.n_heads, cfg.kv_heads, cfg.head_dim, degree)
            for name in [n for n in full if ".attn.qkv." in n]:
                full[name] = full[name][order.argsort()]
        return full
    mine = {n: t.detach().cpu() for n, t in mine.items()}
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    return {n: t for piece in pieces for n, t in piece.items()}


def pipeline_timeline(pipeline_stage, device: torch.device) -> list[tuple[str, int, float, float]]:
    """Record (kind, micro-batch, start, end) of every forward and backward computation the
    stage runs from now on, in a list that the caller clears between steps. Waiting for a
    neighbour's message happens in the schedule, between these calls, so it is not counted.
    On a GPU each computation is waited for, so that the times are the kernels' own."""
    log: list[tuple[str, int, float, float]] = []
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for kind in ("forward", "backward"):
        compute = getattr(pipeline_stage, f"{kind}_one_chunk")

        def timed(chunk, *args, _compute=compute, _kind=kind, **kwargs):
            wait()
            start = time.perf_counter()
            out = _compute(chunk, *args, **kwargs)
            wait()
            log.append((_kind, chunk, start, time.perf_counter()))
            return out

        setattr(pipeline_stage, f"{kind}_one_chunk", timed)
    return log


def in_flight(log: list[tuple[str, int, float, float]]) -> int:
    """The most micro-batches whose activations the stage held at once (forward done, backward
    not yet): M for GPipe, at most the number of stages for 1F1B."""
    held = most = 0
    for kind, *_ in sorted(log, key=lambda event: event[2]):
        held += 1 if kind == "forward" else -1
        most = max(most, held)
    return most


def bubble_per_step(ranks: list[dict]) -> list[float]:
    """For every step of a pipeline run, the share of the step the stages spent not computing:
    1 - (time the S stages computed) / (S x the time from the step's common start, a barrier,
    to the end of the slowest stage's schedule). ``ranks``: every rank's result of
    ``tutorial_lib.parallel_runs.run_case``."""
    steps = zip(*(r["pipeline"]["steps"] for r in ranks))
    return [1 - sum(s["busy"] for s in step) / (len(step) * max(s["seconds"] for s in step)) for step in steps]


def measured_bubble(ranks: list[dict]) -> tuple[float, int]:
    """The bubble of the least disturbed step after the first (which also sends the activations'
    shapes, once), and that step's index. Anything else running on the machine can only
    lengthen a step's waits, so the smallest is the best estimate of the schedule's own."""
    bubbles = bubble_per_step(ranks)
    step = min(range(1, len(bubbles)) if len(bubbles) > 1 else [0], key=bubbles.__getitem__)
    return bubbles[step], step
