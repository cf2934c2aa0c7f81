"""The exercises of notebook 08: each reference agrees with an independent implementation
(PyTorch's own scheduler, GradScaler and DistributedSampler, or a gradient computed on the
whole batch), each named mistake is named, and plausible wrong answers that no mistake
describes are still rejected."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from tutorial_lib.exercises import EXERCISES, check
from tutorial_lib.exercises.core import MISTAKE, PASSED, WRONG
from tutorial_lib.exercises.nb08_training import (
    grad_scaler_scales,
    micro_batch_losses,
    sampler_indices,
    smoothed_targets,
    warmup_cosine_lr,
)
from tutorial_lib.train import warmup_cosine_schedule

NAMES = ["08.warmup_cosine_lr", "08.smoothed_targets", "08.grad_scaler_scales", "08.micro_batch_losses",
         "08.sampler_indices"]


def test_notebooks_08_and_08a_have_these_five_exercises():
    assert [n for n in EXERCISES if n.startswith("08.")] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_reference_passes_and_every_named_mistake_is_named(name):
    exercise = EXERCISES[name]
    assert check(name, exercise.reference).status == PASSED
    assert len(exercise.mistakes) >= 3
    for label, mistake in exercise.mistakes.items():
        result = check(name, mistake.fn)
        assert result.status == MISTAKE and f"'{label}'" in result.message, (label, str(result))


# ---- 08.smoothed_targets ------------------------------------------------------------------------

def test_smoothed_targets_without_never_classes_is_pytorchs_label_smoothing():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(9, 20, generator=g), torch.randint(0, 20, (9,), generator=g)
    q = smoothed_targets(targets, 20, 0.1, [])
    assert torch.allclose(F.cross_entropy(logits, q), F.cross_entropy(logits, targets, label_smoothing=0.1), atol=1e-6)


def test_smoothed_targets_gives_never_classes_nothing_and_the_loss_is_the_formula():
    g = torch.Generator().manual_seed(1)
    logits, targets = torch.randn(6, 14, generator=g), torch.randint(2, 14, (6,), generator=g)
    eps, q = 0.1, smoothed_targets(targets, 14, 0.1, [0, 1])
    assert torch.allclose(q.sum(-1), torch.ones(6)) and not q[:, :2].any()
    logp = logits.log_softmax(-1)
    by_formula = ((1 - eps) * -logp.gather(1, targets[:, None]).squeeze(1) - eps * logp[:, 2:].mean(-1)).mean()
    assert torch.allclose(F.cross_entropy(logits, q), by_formula, atol=1e-6)


def test_smoothed_targets_rejects_the_builtin():
    attempt = lambda targets, vocab_size, eps, never: torch.nn.functional.one_hot(targets, vocab_size)  # noqa: E731
    def uses_it(targets, vocab_size, eps, never):
        return F.cross_entropy(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), label_smoothing=eps)
    assert check("08.smoothed_targets", uses_it).status == WRONG
    assert check("08.smoothed_targets", attempt).status == WRONG


# ---- 08.warmup_cosine_lr ------------------------------------------------------------------------


def test_warmup_cosine_reference_is_the_library_schedule_times_the_peak_and_what_lambdalr_sets():
    for warmup, total, floor in ((10, 100, 0.1), (0, 40, 0.0), (4, 20, 0.5)):
        multiplier = warmup_cosine_schedule(warmup, total, min_ratio=floor)
        param = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([param], lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier)
        for step in range(total + 30):
            assert warmup_cosine_lr(step, 1e-3, warmup, total, floor) == pytest.approx(1e-3 * multiplier(step),
                                                                                          rel=1e-12)
            assert opt.param_groups[0]["lr"] == pytest.approx(warmup_cosine_lr(step, 1e-3, warmup, total, floor),
                                                              rel=1e-12)
            opt.step()
            sched.step()


def test_warmup_cosine_unnamed_wrong_answers_are_rejected():
    def linear_decay(step, peak_lr, warmup_steps, total_steps, min_ratio):  # a straight line, not a cosine
        if step < warmup_steps:
            return peak_lr * (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return peak_lr * (1 - (1 - min_ratio) * progress)

    def uses_the_library(step, peak_lr, warmup_steps, total_steps, min_ratio):
        return peak_lr * warmup_cosine_schedule(warmup_steps, total_steps, min_ratio)(step)

    assert check("08.warmup_cosine_lr", linear_decay).status == WRONG
    result = check("08.warmup_cosine_lr", uses_the_library)
    assert result.status == WRONG and "warmup_cosine_schedule" in result.message


# ---- 08.grad_scaler_scales ---------------------------------------------------------------------


def torch_scaler_scales(found_inf, init_scale, growth_factor, backoff_factor, growth_interval):
    """What torch.amp.GradScaler itself does, on the CPU, with gradients made finite or infinite."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval)
    scales = []
    for overflow in found_inf:
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        if overflow:
            param.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("case", range(5))
def test_grad_scaler_reference_matches_torch_gradscaler(case):
    args = EXERCISES["08.grad_scaler_scales"].cases()[case]
    assert grad_scaler_scales(*args) == torch_scaler_scales(*args)


def test_grad_scaler_reference_matches_torch_on_a_random_run():
    g = torch.Generator().manual_seed(3)
    flags = (torch.rand(300, generator=g) < 0.15).tolist()
    assert grad_scaler_scales(flags, 1024.0, 2.0, 0.5, 7) == torch_scaler_scales(flags, 1024.0, 2.0, 0.5, 7)


def test_grad_scaler_unnamed_wrong_answer_is_rejected():
    def overflow_counts_as_a_step(found_inf, init_scale, growth_factor, backoff_factor, growth_interval):
        scale, steps, scales = init_scale, 0, []
        for overflow in found_inf:  # counts every step towards growth, the skipped ones too
            steps += 1
            if overflow:
                scale *= backoff_factor
            elif steps >= growth_interval:
                scale, steps = scale * growth_factor, 0
            scales.append(scale)
        return scales

    assert check("08.grad_scaler_scales", overflow_counts_as_a_step).status == WRONG


# ---- 08.micro_batch_losses ---------------------------------------------------------------------


@pytest.mark.parametrize("case", range(4))
def test_micro_batch_losses_accumulate_exactly_the_big_batch_gradient(case):
    args = EXERCISES["08.micro_batch_losses"].cases()[case]
    micro_logits, micro_targets = args[0], args[1]
    ignore_index = args[2] if len(args) > 2 else -100
    smoothing = args[3] if len(args) > 3 else 0.0
    leaves = [lg.clone().requires_grad_() for lg in micro_logits]
    for loss in micro_batch_losses(leaves, micro_targets, ignore_index, smoothing):
        loss.backward()  # one backward per micro-batch, as accumulation does
    big = torch.cat([lg.flatten(0, -2) for lg in micro_logits]).requires_grad_()
    F.cross_entropy(big, torch.cat([t.flatten() for t in micro_targets]), ignore_index=ignore_index,
                    label_smoothing=smoothing).backward()
    torch.testing.assert_close(torch.cat([leaf.grad.flatten(0, -2) for leaf in leaves]), big.grad)


def test_micro_batch_losses_unnamed_wrong_answer_is_rejected():
    def smoothing_over_the_other_classes(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
        total = sum(int((t != ignore_index).sum()) for t in micro_targets)
        out = []
        for logits, targets in zip(micro_logits, micro_targets):
            logp = logits.flatten(0, -2).log_softmax(-1)
            flat = targets.flatten()
            keep = flat != ignore_index
            logp, flat = logp[keep], flat[keep]
            target = logp.gather(1, flat[:, None]).squeeze(1)
            others = (logp.sum(-1) - target) / (logp.size(-1) - 1)
            out.append((-(1 - smoothing) * target - smoothing * others).sum() / total)
        return out

    assert check("08.micro_batch_losses", smoothing_over_the_other_classes).status == WRONG


def test_micro_batch_losses_right_values_without_the_graph_are_rejected():
    def rebuilt_from_values(micro_logits, micro_targets, ignore_index=-100, smoothing=0.0):
        # the right numbers, cut off from the logits: backward() runs but gives them no gradient
        return [loss.detach().clone().requires_grad_()
                for loss in micro_batch_losses(micro_logits, micro_targets, ignore_index, smoothing)]

    assert check("08.micro_batch_losses", rebuilt_from_values).status == WRONG


def test_micro_batch_losses_checker_runs_backward_on_each_loss():
    """A constant 0 for the all-padding micro-batch has the reference's value; only backward() tells it apart."""
    exercise = EXERCISES["08.micro_batch_losses"]
    micro_logits, micro_targets, ignore_index, smoothing = exercise.cases()[2]
    assert bool((micro_targets[-1] == ignore_index).all()), "case 2 ends with a micro-batch of padding only"
    constant = exercise.mistakes["a constant 0 for a micro-batch without targets"].fn
    values = [float(v) for v in constant(micro_logits, micro_targets, ignore_index, smoothing)]
    assert values == pytest.approx([float(v) for v in micro_batch_losses(micro_logits, micro_targets, ignore_index,
                                                                          smoothing)])
    with pytest.raises(RuntimeError, match="does not require grad"):
        leaves = [lg.clone().requires_grad_() for lg in micro_logits]
        for loss in constant(leaves, micro_targets, ignore_index, smoothing):
            loss.backward()


# ---- 08.sampler_indices ------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_reference_matches_distributed_sampler(drop_last):
    for n in range(1, 14):
        for replicas in range(1, 7):
            for rank in range(replicas):
                sampler = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=False,
                                             drop_last=drop_last)
                assert sampler_indices(n, replicas, rank, drop_last) == list(sampler), (n, replicas, rank)


def test_sampler_unnamed_wrong_answers_are_rejected():
    def padded_once(n, num_replicas, rank, drop_last=False):  # repeats the list at most once
        per_process = n // num_replicas if drop_last else -(-n // num_replicas)
        total = per_process * num_replicas
        return (list(range(n)) + list(range(n)))[:total][rank::num_replicas]

    def uses_the_sampler(n, num_replicas, rank, drop_last=False):
        return list(DistributedSampler(range(n), num_replicas=num_replicas, rank=rank, shuffle=False,
                                       drop_last=drop_last))

    assert check("08.sampler_indices", padded_once).status == WRONG
    result = check("08.sampler_indices", uses_the_sampler)
    assert result.status == WRONG and "DistributedSampler" in result.message
