"""Exercises of notebook 08 (training recipes)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .core import Exercise, Mistake


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 08.inverse_sqrt_lr: the schedule of the original paper --------------------------------------

def inverse_sqrt_lr(step, d_model, warmup_steps):
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step counted from 1."""
    return d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def _lr_cases():
    return [(1, 512, 4000), (100, 512, 4000), (4000, 512, 4000), (10_000, 512, 4000), (50, 64, 10),
            (5, 64, 10)]


def _lr_max(step, d_model, warmup_steps):
    return d_model ** -0.5 * max(step ** -0.5, step * warmup_steps ** -1.5)


def _lr_warmup_power(step, d_model, warmup_steps):
    return d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -0.5)


def _lr_no_width(step, d_model, warmup_steps):
    return min(step ** -0.5, step * warmup_steps ** -1.5)


# ---- 08.smoothed_loss: label smoothing with an ignore index ----------------------------------------

def smoothed_loss(logits, targets, smoothing, ignore_index=-100):
    """Mean over kept positions of (1 - e) * (-log p[target]) + e * mean over all V classes of (-log p)."""
    logp = logits.log_softmax(dim=-1)  # (N, V)
    keep = targets != ignore_index
    logp, targets = logp[keep], targets[keep]
    nll = -logp.gather(1, targets[:, None]).squeeze(1)
    return ((1 - smoothing) * nll - smoothing * logp.mean(dim=-1)).mean()


def _smooth_cases():
    g = _gen(8)
    cases = []
    for N, V, e in ((6, 5, 0.1), (10, 7, 0.25)):
        logits = torch.randn(N, V, generator=g) * 2
        targets = torch.randint(0, V, (N,), generator=g)
        targets[1] = -100
        targets[-1] = -100
        cases.append((logits, targets, e))
    return cases


def _smooth_over_others(logits, targets, smoothing, ignore_index=-100):
    logp = logits.log_softmax(dim=-1)
    keep = targets != ignore_index
    logp, targets = logp[keep], targets[keep]
    V = logp.size(-1)
    target_logp = logp.gather(1, targets[:, None]).squeeze(1)
    others = (logp.sum(dim=-1) - target_logp) / (V - 1)
    return (-(1 - smoothing) * target_logp - smoothing * others).mean()


def _smooth_ignored_in_mean(logits, targets, smoothing, ignore_index=-100):
    logp = logits.log_softmax(dim=-1)
    keep = targets != ignore_index
    safe = targets.clamp(min=0)
    per_position = (1 - smoothing) * -logp.gather(1, safe[:, None]).squeeze(1) - smoothing * logp.mean(dim=-1)
    return (per_position * keep).sum() / len(targets)


def _smooth_full_weight_on_target(logits, targets, smoothing, ignore_index=-100):
    logp = logits.log_softmax(dim=-1)
    keep = targets != ignore_index
    logp, targets = logp[keep], targets[keep]
    return (-logp.gather(1, targets[:, None]).squeeze(1) - smoothing * logp.mean(dim=-1)).mean()


def _smooth_sum_not_mean(logits, targets, smoothing, ignore_index=-100):
    logp = logits.log_softmax(dim=-1)
    keep = targets != ignore_index
    logp, targets = logp[keep], targets[keep]
    return ((1 - smoothing) * -logp.gather(1, targets[:, None]).squeeze(1) - smoothing * logp.sum(dim=-1)).mean()


# ---- 08.clip_by_global_norm ------------------------------------------------------------------------

def clip_by_global_norm(grads, max_norm):
    """Return (clipped grads, the global norm before clipping). The global norm is the norm of
    all gradients joined into one vector; when it exceeds max_norm every gradient is scaled by
    max_norm / norm, so the direction is kept and the norm becomes max_norm."""
    total = torch.sqrt(sum((g ** 2).sum() for g in grads))
    scale = min(1.0, max_norm / total.item())
    return [g * scale for g in grads], total.item()


def _clip_cases():
    g = _gen(9)
    big = [torch.randn(3, 4, generator=g) * 3, torch.randn(5, generator=g), torch.randn(2, 2, generator=g) * 0.1]
    small = [torch.randn(4, generator=g) * 0.01, torch.randn(2, 3, generator=g) * 0.02]
    return [(big, 1.0), (big, 5.0), (small, 1.0), ([torch.tensor([3.0, 4.0]), torch.tensor([12.0])], 6.5)]


def _clip_per_tensor(grads, max_norm):
    out = [g * min(1.0, max_norm / g.norm().item()) for g in grads]
    return out, torch.sqrt(sum((g ** 2).sum() for g in grads)).item()


def _clip_always(grads, max_norm):
    total = torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
    return [g * (max_norm / total) for g in grads], total


def _clip_norm_after(grads, max_norm):
    clipped, total = clip_by_global_norm(grads, max_norm)
    return clipped, min(total, max_norm)


def _clip_sum_of_norms(grads, max_norm):
    total = sum(g.norm().item() for g in grads)
    return [g * min(1.0, max_norm / total) for g in grads], total


# ---- 08.no_decay_names: which parameters AdamW must not decay --------------------------------------

def no_decay_names(model):
    """Sorted names of the trainable parameters that get no weight decay: every parameter with
    fewer than 2 dimensions (biases, norm scales and shifts) and every nn.Embedding table. A
    parameter shared under two names (tied weights) counts once, under its first name."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sorted(n for n, p in model.named_parameters() if p.requires_grad and (p.dim() < 2 or id(p) in tables))


def _decay_cases():
    from ..config import GPT_TINY, LLAMA_TINY
    from ..gpt import DecoderOnlyLM

    torch.manual_seed(0)
    gpt = DecoderOnlyLM(replace(GPT_TINY, vocab_size=12, d_model=8, n_layers=2, n_heads=2, max_len=8))
    llama = DecoderOnlyLM(replace(LLAMA_TINY, vocab_size=12, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1,
                                  d_ff=12, max_len=8))
    frozen = nn.Sequential(nn.Embedding(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    frozen[1].weight.requires_grad_(False)
    return [(gpt,), (llama,), (frozen,)]


def _decay_only_biases(model):
    return sorted(n for n, p in model.named_parameters() if p.requires_grad and n.endswith("bias"))


def _decay_embeddings(model):
    return sorted(n for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2)


def _decay_tied_twice(model):
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False)
                  if p.requires_grad and (p.dim() < 2 or id(p) in tables))


def _decay_frozen_included(model):
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sorted(n for n, p in model.named_parameters() if p.dim() < 2 or id(p) in tables)


EXERCISES = [
    Exercise(
        name="08.inverse_sqrt_lr",
        task="inverse_sqrt_lr(step, d_model, warmup_steps): the learning rate of Vaswani et al. (2017), "
             "eq. 3, at step (counted from 1): d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5).",
        cases=_lr_cases,
        reference=inverse_sqrt_lr,
        atol=1e-12,
        mistakes={
            "max instead of min": Mistake(
                _lr_max, "The rate is the smaller of the two branches: the linear ramp wins during warmup, "
                         "the 1/sqrt(step) decay after it. With max the rate would grow without bound."),
            "warmup_steps^-0.5 instead of ^-1.5": Mistake(
                _lr_warmup_power, "The ramp is step * warmup_steps^-1.5, so that it meets step^-0.5 exactly "
                                  "at step = warmup_steps (both equal warmup_steps^-0.5 there)."),
            "forgot the d_model^-0.5 factor": Mistake(
                _lr_no_width, "Everything is multiplied by d_model^-0.5: wider models get a smaller rate."),
        },
    ),
    Exercise(
        name="08.smoothed_loss",
        task="smoothed_loss(logits, targets, smoothing, ignore_index=-100): logits (N, V), targets (N,). "
             "Per kept position (1 - smoothing) * (-log p[target]) + smoothing * (mean over all V classes "
             "of -log p); averaged over the positions whose target is not ignore_index (as "
             "F.cross_entropy(..., label_smoothing=smoothing) does).",
        cases=_smooth_cases,
        reference=smoothed_loss,
        mistakes={
            "smoothing spread over the other V-1 classes only": Mistake(
                _smooth_over_others, "PyTorch (and this course) spread the smoothing mass uniformly over all V "
                                     "classes, the target included: the uniform part is the mean of -log p "
                                     "over every class. (Some libraries, e.g. fairseq, use V-1: a different "
                                     "convention, not the one asked for.)"),
            "ignored positions counted in the mean": Mistake(
                _smooth_ignored_in_mean, "Drop the positions whose target is ignore_index before averaging: "
                                         "the mean is over kept positions, not all of them."),
            "kept weight 1 on the target": Mistake(
                _smooth_full_weight_on_target, "The target's term is weighted by (1 - smoothing): the "
                                               "smoothing mass is taken away from it, not added on top."),
            "summed -log p over the classes instead of averaging": Mistake(
                _smooth_sum_not_mean, "The uniform distribution puts 1/V on each class, so the smoothing term "
                                      "is the mean of -log p over the V classes, not their sum."),
        },
    ),
    Exercise(
        name="08.clip_by_global_norm",
        task="clip_by_global_norm(grads, max_norm): grads is a list of tensors. Return (clipped, norm): norm "
             "is the global norm before clipping, sqrt of the sum of every squared entry of every tensor; "
             "when it exceeds max_norm every tensor is multiplied by max_norm / norm, otherwise left alone.",
        cases=_clip_cases,
        reference=clip_by_global_norm,
        mistakes={
            "clipped each tensor on its own": Mistake(
                _clip_per_tensor, "Clip by the *global* norm: one factor for all tensors together, so the "
                                  "direction of the whole gradient is kept."),
            "rescaled even when the norm was below max_norm": Mistake(
                _clip_always, "Clipping only ever shrinks: the factor is min(1, max_norm / norm)."),
            "returned the norm after clipping": Mistake(
                _clip_norm_after, "Report the norm *before* clipping: it is what tells you that a spike "
                                  "happened (after clipping it is never above max_norm)."),
            "added the tensors' norms instead of their squares": Mistake(
                _clip_sum_of_norms, "The global norm is the norm of all entries joined into one vector: "
                                    "sqrt(sum of squared norms), not the sum of the norms."),
        },
    ),
    Exercise(
        name="08.no_decay_names",
        task="no_decay_names(model): the sorted names of the trainable parameters that AdamW must not "
             "decay: every parameter with fewer than 2 dimensions (biases, norm scales and shifts) and every "
             "nn.Embedding table; a tied parameter (one tensor under two names) counts once, under the first "
             "name model.named_parameters() gives it.",
        cases=_decay_cases,
        reference=no_decay_names,
        mistakes={
            "only the biases": Mistake(
                _decay_only_biases, "Norm scales and shifts are 1-D too: decaying a LayerNorm or RMSNorm "
                                    "scale pulls it towards 0, which shrinks the whole layer's output."),
            "embeddings left in the decayed group": Mistake(
                _decay_embeddings, "Embedding tables are 2-D but are lookups, not matrices applied to every "
                                   "input: add every nn.Embedding's weight to the no-decay list."),
            "a tied weight listed twice": Mistake(
                _decay_tied_twice, "model.named_parameters() already yields a shared tensor once; with "
                                   "remove_duplicate=False the tied head.weight comes back as a second name "
                                   "and the optimizer would see the same tensor twice."),
            "frozen parameters included": Mistake(
                _decay_frozen_included, "Leave out parameters with requires_grad=False: the optimizer "
                                        "does not train them at all."),
        },
    ),
]
