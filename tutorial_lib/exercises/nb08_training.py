"""Exercises of notebooks 08 and 08a (training recipes). Notebook 08: a learning rate at a step
of warmup + cosine, and a label-smoothed target that gives never-target classes nothing.
Notebook 08a: the gradient scaler's scale over a run, the exact loss of padded micro-batches,
and the indices a DistributedSampler hands each process (their names keep the prefix "08.").

The notebooks explain each rule in prose and use the library's version of it, where there is
one; none of these functions is written out there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .core import Exercise, Mistake


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 08.warmup_cosine_lr: the learning rate at one step -------------------------------------------

def warmup_cosine_lr(step, peak_lr, warmup_steps, total_steps, min_ratio):
    """Steps counted from 0 (as LambdaLR counts them). Linear warmup: (step + 1) / warmup_steps
    of the peak for step < warmup_steps; then a cosine from the peak down to min_ratio * peak,
    reached at step total_steps and held after it."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _lr_cases():
    #        step, peak,  warmup, total, min_ratio
    return [(0, 1e-3, 10, 100, 0.1),      # the first step of warmup: a tenth of the peak, not 0
            (9, 1e-3, 10, 100, 0.1),      # the last step of warmup reaches the peak
            (10, 1e-3, 10, 100, 0.1),     # the first step of the cosine is still the peak
            (55, 1e-3, 10, 100, 0.1),     # half-way through the decay
            (80, 1e-3, 10, 100, 0.1),
            (100, 1e-3, 10, 100, 0.1),    # the floor
            (250, 1e-3, 10, 100, 0.1),    # held after the end
            (0, 6e-4, 0, 40, 0.0),        # no warmup
            (30, 6e-4, 0, 40, 0.0),
            (3, 2e-3, 4, 20, 0.5)]


def _lr_warmup_from_zero(step, peak_lr, warmup_steps, total_steps, min_ratio):
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    return warmup_cosine_lr(step, peak_lr, warmup_steps, total_steps, min_ratio)


def _lr_to_zero(step, peak_lr, warmup_steps, total_steps, min_ratio):
    return warmup_cosine_lr(step, peak_lr, warmup_steps, total_steps, 0.0)


def _lr_progress_over_total(step, peak_lr, warmup_steps, total_steps, min_ratio):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, step / total_steps)
    return peak_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _lr_not_held(step, peak_lr, warmup_steps, total_steps, min_ratio):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- 08.smoothed_targets: label smoothing without the never-target classes ----------------------

def smoothed_targets(targets, vocab_size, eps, never):
    """The smoothed target distribution, (N, V): PyTorch's convention (1 - eps on the target, eps
    shared equally by the classes, the target among them) with the classes in ``never`` taken out:
    they get 0, and eps is shared by the K = V - len(never) others."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[list(never)] = False
    k = int(allowed.sum())
    q = torch.zeros(len(targets), vocab_size)
    q[:, allowed] = eps / k
    q[torch.arange(len(targets)), targets] += 1 - eps
    return q


def _smooth_cases():
    g = _gen(8)
    cases = []
    for n, vocab, eps, never in ((5, 14, 0.1, [0, 1]), (7, 30, 0.2, [0]), (4, 10, 0.1, []),
                                 (6, 50, 0.05, [0, 1, 2])):
        targets = torch.randint(len(never), vocab, (n,), generator=g)  # never a never-target class
        cases.append((targets, vocab, eps, never))
    return cases


def _smooth_pytorch_convention(targets, vocab_size, eps, never):
    q = torch.full((len(targets), vocab_size), eps / vocab_size)
    q[torch.arange(len(targets)), targets] += 1 - eps
    return q


def _smooth_shared_by_v(targets, vocab_size, eps, never):
    q = smoothed_targets(targets, vocab_size, eps, never)
    allowed = q[0] > 0
    q[:, allowed] -= eps / int(allowed.sum()) - eps / vocab_size
    return q


def _smooth_target_left_out(targets, vocab_size, eps, never):
    q = torch.full((len(targets), vocab_size), eps / (vocab_size - len(never) - 1))
    q[:, list(never)] = 0.0
    q[torch.arange(len(targets)), targets] = 1 - eps
    return q


# ---- 08.grad_scaler_scales: the gradient scaler over a run ------------------------------------------

def grad_scaler_scales(found_inf, init_scale, growth_factor, backoff_factor, growth_interval):
    """The scale after each update(), as torch.amp.GradScaler computes it: an overflow multiplies
    the scale by backoff_factor and restarts the count of good steps; growth_interval good steps
    in a row multiply it by growth_factor and restart the count."""
    scale, good, scales = init_scale, 0, []
    for overflow in found_inf:
        if overflow:
            scale, good = scale * backoff_factor, 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * growth_factor, 0
        scales.append(scale)
    return scales


def _scaler_cases():
    ok, inf = False, True
    return [([ok, ok, ok], 1024.0, 2.0, 0.5, 3),                 # grows at exactly the third good step
            ([inf, ok, ok, inf, ok, ok, ok], 8.0, 2.0, 0.5, 3),  # an overflow restarts the count
            ([ok] * 6, 1.0, 2.0, 0.5, 2),                        # and so does a growth
            ([inf, inf, ok], 100.0, 3.0, 0.25, 1),               # other factors; interval 1
            ([], 65536.0, 2.0, 0.5, 2000),                       # no steps: no scales
            ([ok] * 1999 + [inf] + [ok] * 2001, 65536.0, 2.0, 0.5, 2000)]  # PyTorch's defaults


def _scaler_overflow_keeps_count(found_inf, init_scale, growth_factor, backoff_factor, growth_interval):
    scale, good, scales = init_scale, 0, []
    for overflow in found_inf:
        if overflow:
            scale *= backoff_factor
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * growth_factor, 0
        scales.append(scale)
    return scales


def _scaler_count_not_restarted(found_inf, init_scale, growth_factor, backoff_factor, growth_interval):
    scale, good, scales = init_scale, 0, []
    for overflow in found_inf:
        if overflow:
            scale, good = scale * backoff_factor, 0
        else:
            good += 1
            if good >= growth_interval:
                scale *= growth_factor
        scales.append(scale)
    return scales


def _scaler_one_step_late(found_inf, init_scale, growth_factor, backoff_factor, growth_interval):
    scale, good, scales = init_scale, 0, []
    for overflow in found_inf:
        if overflow:
            scale, good = scale * backoff_factor, 0
        else:
            if good == growth_interval:
                scale, good = scale * growth_factor, 0
            good += 1
        scales.append(scale)
    return scales


def _scaler_before_update(found_inf, init_scale, growth_factor, backoff_factor, growth_interval):
    after = grad_scaler_scales(found_inf, init_scale, growth_factor, backoff_factor, growth_interval)
    return ([init_scale] + after)[:len(after)]


# ---- 08.micro_batch_losses: exact accumulation over padded micro-batches ----------------------------

def micro_batch_losses(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
    """One loss per micro-batch (logits (b, T, V), targets (b, T)) such that their sum is the
    mean label-smoothed loss over every kept target of all micro-batches together: each
    micro-batch's *summed* loss divided by the total number of kept targets. A micro-batch
    with no kept target contributes 0."""
    total = sum(int((t != ignore_index).sum()) for t in micro_targets)
    return [F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index,
                            label_smoothing=smoothing, reduction="sum") / total
            for logits, targets in zip(micro_logits, micro_targets)]


def _micro_cases():
    g = _gen(8)
    V = 7
    # equal counts: every rule that averages per micro-batch is right here
    equal = ([torch.randn(2, 5, V, generator=g) for _ in range(2)], [torch.randint(0, V, (2, 5), generator=g)
                                                                     for _ in range(2)])
    # padded with -100: micro-batches with 10, 6 and 3 kept targets
    logits = [torch.randn(2, 5, V, generator=g) * 2 for _ in range(3)]
    targets = [torch.randint(1, V, (2, 5), generator=g) for _ in range(3)]
    targets[1][:, 3:] = -100
    targets[2][0, :] = -100
    targets[2][1, 3:] = -100
    # PAD = 0 is the ignore index; label smoothing; the last micro-batch is all padding
    pad_logits = [torch.randn(3, 4, V, generator=g) for _ in range(3)]
    pad_targets = [torch.randint(1, V, (3, 4), generator=g) for _ in range(3)]
    pad_targets[0][:, 2:] = 0
    pad_targets[1][2, :] = 0
    pad_targets[2][:] = 0
    return [(*equal,), (logits, targets), (pad_logits, pad_targets, 0, 0.1), (logits, targets, -100, 0.2)]


def _losses_then_backward(fn, args):
    """What the checker compares for 08.micro_batch_losses: the losses' values, whether each
    loss can be backpropagated, and the gradient that backward() on each loss in turn leaves on
    the logits. The logits require grad, as a model's output does."""
    micro_logits = [logits.requires_grad_() for logits in args[0]]  # args are the checker's own copy
    losses = fn(micro_logits, *args[1:])
    if not isinstance(losses, (list, tuple)):
        return losses  # compared as it is: not a list of losses, so wrong
    values, has_graph = [], []
    for loss in losses:
        has_graph.append(isinstance(loss, torch.Tensor) and loss.requires_grad)
        if has_graph[-1]:
            loss.backward()  # one backward per micro-batch, as accumulation does
        values.append(loss.detach() if isinstance(loss, torch.Tensor) else loss)
    gradients = [torch.zeros_like(lg) if lg.grad is None else lg.grad for lg in micro_logits]
    return values, has_graph, gradients


def _micro_constant_zero(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
    losses = micro_batch_losses(micro_logits, micro_targets, ignore_index, smoothing)
    return [torch.tensor(0.0) if bool((t == ignore_index).all()) else loss
            for loss, t in zip(losses, micro_targets)]


def _micro_mean_over_k(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
    k = len(micro_logits)
    return [F.cross_entropy(lg.flatten(0, -2), t.flatten(), ignore_index=ignore_index,
                            label_smoothing=smoothing) / k for lg, t in zip(micro_logits, micro_targets)]


def _micro_all_positions(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
    total = sum(t.numel() for t in micro_targets)
    return [F.cross_entropy(lg.flatten(0, -2), t.flatten(), ignore_index=ignore_index, label_smoothing=smoothing,
                            reduction="sum") / total for lg, t in zip(micro_logits, micro_targets)]


def _micro_default_ignore(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
    return micro_batch_losses(micro_logits, micro_targets, -100, smoothing)


def _micro_weighted_means(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
    counts = [int((t != ignore_index).sum()) for t in micro_targets]
    return [F.cross_entropy(lg.flatten(0, -2), t.flatten(), ignore_index=ignore_index, label_smoothing=smoothing)
            * n / sum(counts) for lg, t, n in zip(micro_logits, micro_targets, counts)]


def _micro_no_smoothing(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
    return micro_batch_losses(micro_logits, micro_targets, ignore_index, 0.0)


# ---- 08.sampler_indices: what DistributedSampler hands each process ----------------------------------

def sampler_indices(n, num_replicas, rank, drop_last=False):
    """The indices of a dataset of n items that DistributedSampler(shuffle=False) gives process
    ``rank`` of ``num_replicas``: without drop_last the list 0..n-1 is padded, repeating it from
    its start, to a multiple of num_replicas; with drop_last it is cut to one. Process r takes
    every num_replicas-th index, starting at r."""
    if drop_last:
        per_process = n // num_replicas
    else:
        per_process = -(-n // num_replicas)  # ceil
    total = per_process * num_replicas
    indices = list(range(n))
    while len(indices) < total:  # padding may repeat the whole list more than once
        indices += list(range(n))[: total - len(indices)]
    return indices[:total][rank::num_replicas]


def _sampler_cases():
    #      n, replicas, rank, drop_last
    return [(10, 4, 0, False), (10, 4, 1, False), (10, 4, 3, False),  # 12 slots: items 0 and 1 again
            (10, 4, 3, True),                                       # 8 slots: 8 and 9 left out
            (8, 4, 2, False),                                       # divides evenly: nothing added
            (2, 5, 4, False),                                       # more processes than items
            (7, 3, 2, True), (7, 3, 2, False)]


def _sampler_blocks(n, num_replicas, rank, drop_last=False):
    per_process = n // num_replicas if drop_last else -(-n // num_replicas)
    total = per_process * num_replicas
    indices = [i % n for i in range(total)]
    return indices[rank * per_process:(rank + 1) * per_process]


def _sampler_pad_with_last(n, num_replicas, rank, drop_last=False):
    per_process = n // num_replicas if drop_last else -(-n // num_replicas)
    total = per_process * num_replicas
    indices = list(range(n)) + [n - 1] * max(0, total - n)
    return indices[:total][rank::num_replicas]


def _sampler_always_padded(n, num_replicas, rank, drop_last=False):
    return sampler_indices(n, num_replicas, rank, False)


def _sampler_unpadded(n, num_replicas, rank, drop_last=False):
    return list(range(n))[rank::num_replicas]


EXERCISES = [
    Exercise(
        name="08.warmup_cosine_lr",
        task="warmup_cosine_lr(step, peak_lr, warmup_steps, total_steps, min_ratio): the learning rate at "
             "step (counted from 0, as LambdaLR counts): peak_lr * (step + 1) / warmup_steps while step < "
             "warmup_steps; then a cosine from peak_lr down to min_ratio * peak_lr, reached at step "
             "total_steps and held after it.",
        cases=_lr_cases,
        reference=warmup_cosine_lr,
        atol=1e-12,
        forbidden=("warmup_cosine_schedule", "LambdaLR", "CosineAnnealingLR", "SequentialLR", "LinearLR"),
        mistakes={
            "warmup starts at 0": Mistake(
                _lr_warmup_from_zero, "LambdaLR counts steps from 0, and the first step should already "
                                      "move the weights: (step + 1) / warmup_steps, so that step 0 gets "
                                      "1/warmup of the peak and step warmup_steps - 1 the whole peak."),
            "the cosine ends at 0": Mistake(
                _lr_to_zero, "The cosine runs from the peak down to min_ratio * peak, not to 0: "
                             "min_ratio + (1 - min_ratio) * (1 + cos(pi * progress)) / 2."),
            "progress counted from step 0, not from the end of warmup": Mistake(
                _lr_progress_over_total, "The decay starts where warmup ends: progress = (step - warmup_steps)"
                                         " / (total_steps - warmup_steps), 0 at the end of warmup and 1 at "
                                         "total_steps."),
            "the rate rises again after total_steps": Mistake(
                _lr_not_held, "Past total_steps the cosine would climb back towards the peak: cap the "
                              "progress at 1, so the rate stays at its floor."),
        },
    ),
    Exercise(
        name="08.smoothed_targets",
        task="smoothed_targets(targets, vocab_size, eps, never): the (N, V) smoothed target distribution for "
             "the class ids targets (N,): 1 - eps on the target plus an equal share of eps for each of the "
             "K = V - len(never) classes not in never (the target among them, as in PyTorch's convention); 0 "
             "on the classes in never. Every row sums to 1.",
        cases=_smooth_cases,
        reference=smoothed_targets,
        atol=1e-7,
        forbidden=("label_smoothing",),
        mistakes={
            "the never-target classes still get eps / V": Mistake(
                _smooth_pytorch_convention, "That is PyTorch's label_smoothing, which spreads eps over all V "
                                            "classes, PAD and BOS included: set the classes in never to 0 and "
                                            "share eps among the other K = V - len(never)."),
            "eps shared by V, not by the K allowed classes": Mistake(
                _smooth_shared_by_v, "With the never classes at 0, each allowed class must get eps / K, "
                                     "K = V - len(never); eps / V leaves the row summing to less than 1."),
            "the target left out of the share": Mistake(
                _smooth_target_left_out, "That is the Annotated Transformer's form (1 - eps on the target, eps "
                                         "over the other classes). The task keeps PyTorch's convention: the "
                                         "target is one of the K classes that share eps, so it gets "
                                         "1 - eps + eps / K."),
        },
    ),
    Exercise(
        name="08.grad_scaler_scales",
        task="grad_scaler_scales(found_inf, init_scale, growth_factor, backoff_factor, growth_interval): "
             "found_inf is a list of bools, one per step (True: the scaled gradients overflowed, the step is "
             "skipped). Return the list of scales after each update(), as torch.amp.GradScaler computes them.",
        cases=_scaler_cases,
        reference=grad_scaler_scales,
        mistakes={
            "an overflow does not restart the count of good steps": Mistake(
                _scaler_overflow_keeps_count, "The scale grows after growth_interval good steps *in a row*: "
                                              "an overflow sets the count back to 0 as well as shrinking "
                                              "the scale."),
            "the count is not restarted after growing": Mistake(
                _scaler_count_not_restarted, "After growing, the scaler starts counting good steps from 0 "
                                             "again; otherwise it would grow at every step from then on."),
            "grows one step late": Mistake(
                _scaler_one_step_late, "Count the good step first, then compare: the scale grows at the "
                                       "growth_interval-th good step itself (step 3 of [ok, ok, ok] with "
                                       "growth_interval=3)."),
            "returned the scale before each update": Mistake(
                _scaler_before_update, "Return the scale *after* each update(): the first entry already "
                                       "reflects the first step (an overflow there halves it at once)."),
        },
    ),
    Exercise(
        name="08.micro_batch_losses",
        task="micro_batch_losses(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0): lists of "
             "logits (b, T, V) and targets (b, T), one pair per micro-batch. Return one scalar loss per "
             "micro-batch such that their sum is the mean label-smoothed cross-entropy over every target that "
             "is not ignore_index in all micro-batches together (so backward() on each accumulates exactly "
             "the big batch's gradient; the logits require grad, and the checker calls backward() on each "
             "loss and compares the gradients). A micro-batch with no kept target gives a 0 that backward() "
             "accepts, not NaN.",
        cases=_micro_cases,
        reference=micro_batch_losses,
        run=_losses_then_backward,
        mistakes={
            "each micro-batch's mean divided by k": Mistake(
                _micro_mean_over_k, "mean / k weighs every micro-batch alike, so a target in a short "
                                    "micro-batch counts more than one in a full one. Sum each micro-batch's "
                                    "per-target losses and divide by the number of kept targets of all "
                                    "micro-batches together."),
            "divided by every position, ignored ones included": Mistake(
                _micro_all_positions, "Padding positions are not targets: count only the targets that are "
                                      "not ignore_index."),
            "ignore_index fixed at -100": Mistake(
                _micro_default_ignore, "Use the ignore_index you are given: with PAD = 0 as the ignore index, "
                                       "-100 never matches and every PAD position is counted as a target."),
            "weighted each micro-batch's mean (NaN without targets)": Mistake(
                _micro_weighted_means, "Weighting each mean by its count is exact, except for a micro-batch "
                                       "with no target: its mean is 0/0 = NaN, and NaN * 0 is NaN. Sum the "
                                       "losses instead (reduction='sum' gives 0 there)."),
            "a constant 0 for a micro-batch without targets": Mistake(
                _micro_constant_zero, "torch.tensor(0.) has the right value but no graph: backward() on it "
                                      "raises 'element 0 of tensors does not require grad and does not have a "
                                      "grad_fn'. Return a 0 that is part of the graph: the summed per-target "
                                      "loss over no targets (reduction='sum') is one."),
            "label smoothing left out": Mistake(
                _micro_no_smoothing, "Pass smoothing on to the per-target loss (label_smoothing=...): the "
                                     "weighting does not change the loss of each target."),
        },
    ),
    Exercise(
        name="08.sampler_indices",
        task="sampler_indices(n, num_replicas, rank, drop_last=False): the list of indices of a dataset of n "
             "items that DistributedSampler(dataset, num_replicas, rank, shuffle=False, drop_last=drop_last) "
             "yields for process rank.",
        cases=_sampler_cases,
        reference=sampler_indices,
        forbidden=("DistributedSampler",),
        mistakes={
            "contiguous blocks instead of every num_replicas-th index": Mistake(
                _sampler_blocks, "DistributedSampler interleaves: process r takes indices r, r + R, r + 2R, ... "
                                 "of the padded list, not a block of consecutive ones."),
            "padded by repeating the last item": Mistake(
                _sampler_pad_with_last, "The padding repeats the list from its *start* (items 0, 1, ...), "
                                        "not the last item."),
            "drop_last ignored": Mistake(
                _sampler_always_padded, "With drop_last=True the list is cut down to a multiple of "
                                        "num_replicas instead of padded up: the last n % num_replicas items "
                                        "are left out."),
            "no padding": Mistake(
                _sampler_unpadded, "Every process must get the same number of indices (otherwise they would "
                                   "wait for each other's gradients at the end of an epoch): the list is "
                                   "padded to a multiple of num_replicas."),
        },
    ),
]
