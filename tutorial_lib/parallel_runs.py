"""The two-process runs of notebook 10 and of the tests: every scheme of
:mod:`tutorial_lib.parallel` trains the course's tiny GPT or LLaMA for a few steps, and each
rank reports what it measured beside the formulas.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tutorial_lib.parallel_runs \\
        --cases '[{"scheme": "tp", "flavour": "llama"}]' --out result.json

runs the cases in 2 processes (gloo on the CPU; NCCL with ``--device auto`` when every process
has a GPU of its own); rank 0 writes every rank's results to ``--out``. :func:`launch_cases`
starts it through ``tutorial_lib.ddp.launch`` (one launch for many cases: starting processes
costs seconds). :func:`train_one_process` is the reference every scheme must reproduce: one
process, the whole model, the same global batch at every step.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .checks import check_count
from .config import GPT_TINY, LLAMA_TINY, ModelConfig
from .ddp import corpus_ids, global_batch, init_processes, launch, leave_without_teardown, shard
from .gpt import DecoderOnlyLM
from .parallel import (
    SCHEDULES,
    SCHEMES,
    CommCounter,
    apply_ddp,
    apply_fsdp,
    apply_fsdp_tp,
    apply_tensor_parallel,
    build_pipeline,
    expected_memory,
    expected_traffic,
    full_gradients,
    full_weights,
    held_bytes,
    in_flight,
    local_tensor,
    pipeline_timeline,
    rank_parameters,
    sync_tied_embedding,
    tp_pairs,
    two_d_mesh,
)
from .train import param_group_names

FLAVOURS = ("gpt", "llama")
VOCAB_MULTIPLE = 8  # the vocabulary is padded to a multiple of this, so that it splits over 2, 4 or 8 ranks
WEIGHT_DECAY, BETAS, EPS = 0.1, (0.9, 0.95), 1e-8

# ---- the run: what a case trains ------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One training run: a scheme, a model flavour and the sizes.

    ``batch`` is the *global* batch (windows of ``block`` characters per optimiser step): data
    parallelism gives each of N ranks batch / N of them, tensor parallelism gives every rank all
    of them, fsdp_tp gives each of the N / 2 tensor-parallel pairs batch / (N / 2) of them,
    pipeline parallelism cuts them into ``microbatches``. ``schedule`` (pipeline) and
    ``vocab_parallel`` (tensor parallelism: split the embedding and the head by vocabulary) only
    matter to their scheme. ``weights=False`` leaves the trained weights and the gradients out
    of the result. ``tied_reduce="mean"`` makes a pipeline of a tied model average the two
    copies' gradients of the token table instead of summing them (a mistake, kept to show that
    the equality check catches it: :func:`tutorial_lib.parallel.sync_tied_embedding`).
    """

    scheme: str
    flavour: str = "gpt"
    steps: int = 3
    batch: int = 8
    block: int = 16
    d_model: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # the LLaMA flavour's key/value heads (GPT: one per query head)
    microbatches: int = 4
    schedule: str = "gpipe"
    vocab_parallel: bool = True
    lr: float = 1e-3
    seed: int = 0
    corpus_chars: int = 20_000
    weights: bool = True
    tied_reduce: str = "sum"

    def __post_init__(self) -> None:
        for name, allowed in (("scheme", SCHEMES), ("flavour", FLAVOURS), ("schedule", SCHEDULES),
                              ("tied_reduce", ("sum", "mean"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("steps", "batch", "block", "d_model", "n_layers", "n_heads", "n_kv_heads", "microbatches",
                     "corpus_chars"):
            check_count(name, getattr(self, name))
        if self.batch % self.microbatches:
            raise ValueError(f"a batch of {self.batch} does not split into {self.microbatches} equal micro-batches")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@functools.lru_cache(maxsize=4)
def _corpus(n_chars: int) -> tuple[Tensor, int]:
    return corpus_ids(n_chars)


def case_model(case: Case) -> tuple[ModelConfig, Tensor]:
    """The config of the case's tiny model and the corpus as ids. GPT: learned positions,
    LayerNorm, GELU, biases, tied head. LLaMA: RoPE, RMSNorm, SwiGLU, grouped-query attention
    (by default 4 query heads sharing 2 key/value heads), FFN width 2 d, no biases, untied
    head. The vocabulary is padded to a multiple of :data:`VOCAB_MULTIPLE` (as Megatron-LM
    pads it), so that it splits evenly by rows."""
    stream, vocab_size = _corpus(case.corpus_chars)
    vocab_size = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    sizes = dict(vocab_size=vocab_size, d_model=case.d_model, n_layers=case.n_layers, n_heads=case.n_heads,
                 max_len=case.block, dropout=0.0)
    if case.flavour == "gpt":
        return replace(GPT_TINY, **sizes), stream
    return replace(LLAMA_TINY, **sizes, n_kv_heads=case.n_kv_heads, d_ff=2 * case.d_model), stream


def make_adamw(module: nn.Module, decay: set[str], lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the parameters named in ``decay`` (the names
    ``tutorial_lib.train.param_group_names`` gives the whole model; every plan here keeps them).
    One update per tensor (``foreach=False``): a tensor-parallel model mixes DTensors with
    plain tensors, which one fused update cannot take."""
    named = dict(module.named_parameters())
    groups = [{"params": [p for n, p in named.items() if n in decay], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, foreach=False)


def train_one_process(case: Case) -> dict:
    """The reference: one process trains the whole model on the whole global batch of every
    step. Returns the losses, every step's gradients, the trained weights and how far training
    moved them."""
    cfg, stream = case_model(case)
    torch.manual_seed(case.seed)
    model = DecoderOnlyLM(cfg)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_adamw(model, set(param_group_names(model)["decay"]), case.lr)
    losses, gradients = [], []
    for step in range(case.steps):
        ids, targets = global_batch(stream, step, case.batch, case.block, case.seed)
        optimizer.zero_grad()
        loss = model(ids, targets).loss
        loss.backward()
        gradients.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    update = torch.cat([(weights[n] - start[n]).flatten() for n in weights])
    return {"loss": losses, "weights": weights, "gradients": gradients, "update_norm": update.norm().item(),
            "largest_change": update.abs().max().item()}


def prepare(case: Case, rank: int, world_size: int, device: torch.device):
    """Build the case's model on this rank with its scheme applied, and its optimiser. Returns
    (cfg, module, optimizer, step, log): ``step(ids, targets)`` runs the forward and backward
    pass of one global batch as the scheme does (this rank's part of it) and returns the
    global batch's loss as this rank knows it and, for a pipeline, the seconds its schedule
    took; ``log`` is the pipeline's timeline (None for the other schemes)."""
    cfg, _ = case_model(case)
    torch.manual_seed(case.seed)  # the same initial weights on every rank, and as in train_one_process
    model = DecoderOnlyLM(cfg).to(device)
    decay = set(param_group_names(model)["decay"])  # names every plan keeps
    build = {"ddp": data_parallel_step, "fsdp": data_parallel_step, "tp": tensor_parallel_step,
             "pp": pipeline_step, "fsdp_tp": two_d_step}[case.scheme]
    module, step, log = build(case, model, rank, world_size, device)
    optimizer = make_adamw(module.module if case.scheme == "ddp" else module, decay, case.lr)
    return cfg, module, optimizer, step, log


def data_parallel_step(case: Case, model: DecoderOnlyLM, rank: int, world_size: int, device: torch.device):
    """DDP or FSDP: each rank runs its 1/N of the global batch forward and backward, and the
    engine averages the gradients inside backward(). Returns (module, step, None)."""
    from torch.distributed.device_mesh import init_device_mesh

    module = (apply_ddp(model, device) if case.scheme == "ddp"
              else apply_fsdp(model, init_device_mesh(device.type, (world_size,))))

    def step(ids, targets):
        loss = module(*shard((ids, targets), rank, world_size)).loss  # this rank's rows
        loss.backward()  # DDP all-reduces the gradients; FSDP reduce-scatters them
        return loss, None

    return module, step, None


def tensor_parallel_step(case: Case, model: DecoderOnlyLM, rank: int, world_size: int, device: torch.device):
    """Every rank runs the whole global batch through its slices of every matrix. With the
    vocabulary split, the logits stay split too, and the loss and its backward pass run inside
    ``loss_parallel()``, which computes the cross-entropy from the split logits. Returns
    (module, step, None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    module = apply_tensor_parallel(model, init_device_mesh(device.type, (world_size,)),
                                   vocab_parallel=case.vocab_parallel)
    context = loss_parallel if case.vocab_parallel else nullcontext

    def step(ids, targets):
        with context():  # the loss from logits split by vocabulary
            loss = module(ids, targets).loss  # every rank: the whole batch
            loss.backward()
        return local_tensor(loss), None

    return module, step, None


def two_d_step(case: Case, model: DecoderOnlyLM, rank: int, world_size: int, device: torch.device):
    """FSDP across tensor-parallel pairs (:func:`tutorial_lib.parallel.apply_fsdp_tp`): pair g
    runs its 1/G of the global batch, both of its ranks the same rows, each through its slices
    of every matrix; the loss is computed from the split logits as in tensor parallelism.
    Returns (module, step, None)."""
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = two_d_mesh(device.type, world_size)
    module = apply_fsdp_tp(model, mesh, vocab_parallel=case.vocab_parallel)
    context = loss_parallel if case.vocab_parallel else nullcontext
    pair, pairs = mesh["dp"].get_local_rank(), tp_pairs(world_size)

    def step(ids, targets):
        with context():
            loss = module(*shard((ids, targets), pair, pairs)).loss  # this pair's rows
            loss.backward()  # tp's all-reduces within the pair, FSDP's reduce-scatter across pairs
        return local_tensor(loss), None

    return module, step, None


def pipeline_step(case: Case, model: DecoderOnlyLM, rank: int, world_size: int, device: torch.device):
    """Rank r runs stage r. The schedule cuts the global batch into micro-batches: the first
    stage feeds it the ids, the last the targets, and gets back each micro-batch's loss; the
    schedule runs forward and backward. A tied model then sums its two copies' gradients of
    the token table. Returns (module, step, the timeline of the stage's computations)."""
    module, pipeline_stage, schedule = build_pipeline(model, rank, world_size, case.microbatches,
                                                      case.schedule, device)
    log = pipeline_timeline(pipeline_stage, device)
    tie_group = dist.new_group([0, world_size - 1]) if model.cfg.tie_embeddings else None

    def step(ids, targets):
        start, micro_losses = time.perf_counter(), []
        if rank == 0:
            schedule.step(ids)
        elif rank == world_size - 1:
            schedule.step(target=targets, losses=micro_losses)
        else:
            schedule.step()
        seconds = time.perf_counter() - start
        if tie_group is not None and rank in (0, world_size - 1):
            sync_tied_embedding(module, tie_group, case.tied_reduce)
        return (torch.stack(micro_losses).mean() if micro_losses else torch.zeros(())), seconds

    return module, step, log


def run_case(case: Case, rank: int, world_size: int, device: torch.device) -> dict:
    """Train ``case`` on this rank (the process group must be up); return what it measured:
    the global batch's loss at every step, the bytes it holds after the last step, what it
    handed to collectives in the last step, each beside its formula; a pipeline's timeline;
    rank 0 also returns every trained weight and every step's gradients, whole."""
    cfg, module, optimizer, step, log = prepare(case, rank, world_size, device)
    _, stream = case_model(case)
    losses, seconds, pipeline_steps, gradients = [], [], [], []
    for i in range(case.steps):
        ids, targets = (t.to(device) for t in global_batch(stream, i, case.batch, case.block, case.seed))
        if log is not None:
            log.clear()
        dist.barrier()  # a common start, for the pipeline's timeline
        start = time.perf_counter()
        with CommCounter() as counter:
            optimizer.zero_grad()
            loss, schedule_seconds = step(ids, targets)
            optimizer.step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        if case.weights:  # what the optimiser was given (outside the counter: gathering them is a collective)
            gradients.append(full_gradients(case.scheme, module))
        if log is not None:  # the step's timeline, from its start
            pipeline_steps.append({"busy": sum(end - begin for _, _, begin, end in log),
                                   "seconds": schedule_seconds, "in_flight": in_flight(log),
                                   "events": [(kind, mb, a - start, b - start) for kind, mb, a, b in log]})
    kwargs = dict(vocab_parallel=case.vocab_parallel)
    result = {"rank": rank, "loss": _global_losses(case.scheme, losses, world_size, device), "seconds": seconds,
              "parameters": rank_parameters(cfg, case.scheme, world_size, rank, **kwargs),
              "memory": held_bytes(module, optimizer),
              "expected_memory": expected_memory(cfg, case.scheme, world_size, rank, **kwargs),
              "traffic": counter.summary(),  # of the last step
              "expected_traffic": expected_traffic(cfg, case.scheme, world_size, rank, batch=case.batch,
                                                   seq_len=case.block, **kwargs)}
    if log is not None:
        result["pipeline"] = {"steps": pipeline_steps}
    weights = full_weights(case.scheme, module) if case.weights else {}
    if rank == 0 and weights:
        result["weights"] = {n: t.tolist() for n, t in weights.items()}
        result["gradients"] = [{n: t.tolist() for n, t in g.items()} for g in gradients]
    return result


def _global_losses(scheme: str, losses: list[float], world_size: int, device: torch.device) -> list[float]:
    """The global batch's loss at every step: the mean of the data-parallel ranks' losses (equal
    token counts), tensor parallelism's (the same on every rank), or the pipeline's last stage's
    mean over its micro-batches."""
    if scheme in ("ddp", "fsdp", "fsdp_tp"):  # fsdp_tp: both ranks of a pair hold its loss
        total = torch.tensor(losses, dtype=torch.float64, device=device)  # NCCL reduces GPU tensors only
        dist.all_reduce(total)
        return (total / world_size).tolist()
    if scheme == "pp":
        shared = [losses]
        dist.broadcast_object_list(shared, src=world_size - 1)
        return shared[0]
    return losses


# ---- the script ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description="Run cases of tutorial_lib.parallel_runs in every process.")
    parser.add_argument("--cases", required=True, help="a JSON list of Case fields, e.g. '[{\"scheme\": \"tp\"}]'")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto",
                        help="auto: one GPU per process (NCCL) when the machine has enough, else the CPU (gloo)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", type=Path, default=None, help="rank 0 writes every rank's results here (JSON)")
    args = parser.parse_args(argv)
    cases = [Case(**fields) for fields in json.loads(args.cases)]
    torch.set_num_threads(args.threads)
    rank, world_size, device, backend = init_processes(args.device)
    if world_size < 2:
        raise ValueError("run this script in 2 or more processes, under torchrun (see the module docstring)")
    try:
        mine = [run_case(case, rank, world_size, device) for case in cases]
        everyone = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    result = {"world_size": world_size, "backend": backend, "device": device.type,
              "cases": [[ranks[i] for ranks in everyone] for i in range(len(cases))]}
    if args.out is not None:
        args.out.write_text(json.dumps(result))
    return result


def launch_cases(cases: list[Case], nproc: int = 2, *, device: str = "cpu", timeout: float = 600) -> list[list[dict]]:
    """Run ``cases`` in ``nproc`` processes (one launch) and return, for each case, the list of
    every rank's result; the trained weights and gradients (rank 0's) come back as tensors."""
    if not cases or not all(isinstance(c, Case) for c in cases):
        raise ValueError(f"cases must be a non-empty list of Case, got {cases!r}")
    out = launch(nproc, ["--cases", json.dumps([asdict(c) for c in cases]), "--device", device],
                 module="tutorial_lib.parallel_runs", timeout=timeout)
    for ranks in out["cases"]:
        ranks[0]["weights"] = {n: torch.tensor(v) for n, v in ranks[0].get("weights", {}).items()}
        ranks[0]["gradients"] = [{n: torch.tensor(v) for n, v in g.items()} for g in ranks[0].get("gradients", [])]
    return out["cases"]


def compare(ranks: list[dict], reference: dict) -> dict[str, float | str]:
    """How far a parallel run is from the one-process reference.

    ``loss``: the largest difference of the losses. ``gradients``: the largest relative
    difference of any parameter's gradient, ||g - g_ref|| / ||g_ref|| tensor by tensor, over
    every step (``gradients_worst`` names that tensor); AdamW divides each gradient by its own
    running size, so a tensor whose gradient is off by a constant factor takes nearly the same
    steps, and only this comparison sees it. ``weights``: the largest difference of any weight
    after the last step; ``weights_relative``: the size of all the weights' differences (the
    Euclidean norm over every weight) relative to how far training moved them,
    ||w - w_ref|| / ||w_ref - w_0||."""
    weights, gradients = ranks[0]["weights"], ranks[0].get("gradients", [])
    missing = sorted(set(reference["weights"]) - set(weights))
    if missing:
        raise ValueError(f"the parallel run returned no weights for {missing}")
    if len(gradients) != len(reference["gradients"]):
        raise ValueError(f"the parallel run returned the gradients of {len(gradients)} steps, "
                         f"the reference of {len(reference['gradients'])}")
    worst, worst_name = 0.0, ""
    for mine, theirs in zip(gradients, reference["gradients"]):
        for name, g_ref in theirs.items():
            if name not in mine:
                raise ValueError(f"the parallel run returned no gradient for {name}")
            off, size = (mine[name] - g_ref).norm().item(), g_ref.norm().item()
            relative = off / size if size > 0 else (0.0 if off == 0 else float("inf"))
            if relative >= worst:
                worst, worst_name = relative, name
    differences = torch.cat([(weights[n] - w).flatten() for n, w in reference["weights"].items()])
    return {"loss": max(abs(a - b) for a, b in zip(ranks[0]["loss"], reference["loss"])),
            "gradients": worst, "gradients_worst": worst_name,
            "weights": differences.abs().max().item(),
            "weights_relative": differences.norm().item() / reference["update_norm"]}


if __name__ == "__main__":
    main()
    leave_without_teardown()  # see tutorial_lib.ddp: gloo's teardown can abort a finished run

