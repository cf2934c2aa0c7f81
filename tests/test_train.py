"""The training loop and its parts: schedules against the paper's formula, the label-smoothed
loss against PyTorch's, parameter groups, clipping, accumulation, precision, non-finite stops,
callbacks."""

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.train import (
    History,
    NonFiniteError,
    autocast_context,
    constant_schedule,
    inverse_sqrt_schedule,
    label_smoothed_loss,
    make_optimizer,
    param_group_names,
    param_groups,
    train,
    warmup_cosine_schedule,
)

CFG = replace(GPT_TINY, vocab_size=16, d_model=16, n_layers=2, n_heads=2, max_len=12)


def tiny_model(seed=0, **changes):
    torch.manual_seed(seed)
    return DecoderOnlyLM(replace(CFG, **changes))


def fixed_batches(n, batch=4, T=8, V=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (batch, T), generator=g), torch.randint(0, V, (batch, T), generator=g))
            for _ in range(n)]


def quiet_train(model, batches, steps, **kwargs):
    kwargs.setdefault("optimizer", make_optimizer(model, 1e-2))
    return train(model, lambda i: batches[i], steps, progress=False, **kwargs)


# ---- schedules ---------------------------------------------------------------------------------


def paper_lrate(step, d_model, warmup):
    """Vaswani et al. (2017), section 5.3, eq. 3 (step counted from 1)."""
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def test_inverse_sqrt_schedule_matches_the_papers_formula_through_lambdalr():
    d_model, warmup = 512, 4000
    peak = d_model ** -0.5 * warmup ** -0.5
    assert peak == pytest.approx(6.9877e-4, rel=1e-4)  # 1 / sqrt(512 * 4000)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_schedule(warmup))
    for s in range(1, 6):  # stepping through: the rate used at paper step s
        assert opt.param_groups[0]["lr"] == pytest.approx(paper_lrate(s, d_model, warmup), rel=1e-12), s
        opt.step()
        sched.step()
    for s in (1000, 3999, 4000, 4001, 10000, 100000):  # jumping there, as a resumed run does
        torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_schedule(warmup), last_epoch=s - 2)
        assert opt.param_groups[0]["lr"] == pytest.approx(paper_lrate(s, d_model, warmup), rel=1e-12), s


def test_inverse_sqrt_schedule_hand_values_and_validation():
    f = inverse_sqrt_schedule(4)
    assert [f(k) for k in (0, 1, 3, 15, 63)] == [0.25, 0.5, 1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match=r"warmup_steps must be a positive int \(an int >= 1\), got 0"):
        inverse_sqrt_schedule(0)


def test_warmup_cosine_schedule_hand_values_and_validation():
    f = warmup_cosine_schedule(2, 6, min_ratio=0.1)
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55, None, 0.1, 0.1]
    for k, e in enumerate(expected):
        if e is not None:
            assert f(k) == pytest.approx(e, abs=1e-12), k
    assert f(1000) == pytest.approx(0.1)
    assert warmup_cosine_schedule(0, 4, 0.0)(0) == 1.0  # no warmup: starts at the peak
    with pytest.raises(ValueError, match="warmup_steps < total_steps"):
        warmup_cosine_schedule(5, 5)
    with pytest.raises(ValueError, match="min_ratio"):
        warmup_cosine_schedule(1, 5, min_ratio=1.5)


def test_constant_schedule():
    assert [constant_schedule(4)(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert constant_schedule()(0) == 1.0
    with pytest.raises(ValueError, match=r"warmup_steps must be a non-negative int \(an int >= 0\), got -1"):
        constant_schedule(-1)


def test_train_applies_the_schedule_and_a_resumed_run_continues_it():
    f = warmup_cosine_schedule(3, 8)
    batches = fixed_batches(8)
    model = tiny_model()
    opt = make_optimizer(model, 1e-2)
    history = quiet_train(model, batches, 5, optimizer=opt, schedule=f)
    assert history.lr == pytest.approx([1e-2 * f(k) for k in range(5)], rel=1e-12)
    history = quiet_train(model, batches, 8, optimizer=opt, schedule=f, start_step=5, history=history)
    assert history.step == list(range(1, 9))
    assert history.lr == pytest.approx([1e-2 * f(k) for k in range(8)], rel=1e-12)


# ---- loss --------------------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_equals_torch_cross_entropy_with_ignore_index(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g) * 3
    targets = torch.randint(0, 7, (3, 5), generator=g)
    targets[0, :2] = -100
    targets[2, 4] = -100
    ours = label_smoothed_loss(logits, targets, smoothing)
    theirs = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=smoothing)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    relabelled = torch.where(targets == -100, torch.full_like(targets, -1), targets)
    torch.testing.assert_close(label_smoothed_loss(logits, relabelled, smoothing, ignore_index=-1), ours)
    changed = logits.clone()
    changed[0, :2] += 100.0  # what the model predicts at an ignored position does not count
    torch.testing.assert_close(label_smoothed_loss(changed, targets, smoothing), ours)


def test_label_smoothed_loss_hand_values():
    # uniform logits: every class has probability 1/V, so the loss is log V whatever the smoothing
    assert label_smoothed_loss(torch.zeros(2, 4), torch.tensor([1, 3]), 0.2).item() == pytest.approx(math.log(4))
    # V = 2, p(target) = sigmoid(2): nll = log(1 + e^-2), the other class costs log(1 + e^2)
    logits, target = torch.tensor([[2.0, 0.0]]), torch.tensor([0])
    nll, other = math.log1p(math.exp(-2)), math.log1p(math.exp(2))
    expected = 0.9 * nll + 0.1 * (nll + other) / 2
    assert label_smoothed_loss(logits, target, 0.1).item() == pytest.approx(expected, rel=1e-6)


def test_label_smoothed_loss_rejects_bad_input():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="smoothing must lie"):
        label_smoothed_loss(logits, torch.zeros(2, 3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="do not match"):
        label_smoothed_loss(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="every value of targets equals ignore_index=-100"):
        label_smoothed_loss(logits, torch.full((2, 3), -100))
    with pytest.raises(ValueError, match=r"targets must hold class ids in \[0, 4\] \(size 5\) or ignore_index=-100 "
                                         r"\(positions without a target\); it holds \[5\], first at targets\[0, 0\]"):
        label_smoothed_loss(logits, torch.full((2, 3), 5))
    with pytest.raises(ValueError, match="integer class ids"):
        label_smoothed_loss(logits, torch.zeros(2, 3))


# ---- parameter groups ----------------------------------------------------------------------------


def test_param_groups_decay_matrices_only_and_count_tied_weights_once():
    model = tiny_model()  # GPT flavour: tied head, learned positions, LayerNorm with bias
    assert model.head.weight is model.embed.tokens.weight
    names = param_group_names(model)
    assert set(names["decay"]) == {f"blocks.{i}.{part}.weight" for i in range(2)
                                   for part in ("attn.qkv", "attn.out", "ffn.up", "ffn.down")}
    assert "embed.tokens.weight" in names["no_decay"] and "head.weight" not in names["no_decay"] + names["decay"]
    assert "embed.positions.embedding.weight" in names["no_decay"]
    assert all(n.endswith(".bias") or "norm" in n or "embed" in n for n in names["no_decay"])
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    in_groups = [p for g in groups for p in g["params"]]
    assert len({id(p) for p in in_groups}) == len(in_groups) == len(list(model.parameters()))
    assert sum(p.numel() for p in in_groups) == sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, 1e-3)
    assert opt.param_groups[0]["params"] == groups[0]["params"] and opt.param_groups[1]["weight_decay"] == 0.0


def test_param_groups_untied_llama_decays_its_head_and_not_rmsnorm():
    torch.manual_seed(0)
    model = DecoderOnlyLM(replace(LLAMA_TINY, vocab_size=16, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24,
                                  n_layers=1))
    names = param_group_names(model)
    assert "head.weight" in names["decay"] and "embed.tokens.weight" in names["no_decay"]
    assert "final_norm.weight" in names["no_decay"] and "blocks.0.ffn.gate.weight" in names["decay"]
    frozen = tiny_model()
    frozen.embed.tokens.weight.requires_grad_(False)
    assert "embed.tokens.weight" not in sum(param_group_names(frozen).values(), [])
    with pytest.raises(ValueError, match="weight_decay"):
        param_groups(model, -0.1)
    with pytest.raises(ValueError, match="lr must be positive"):
        make_optimizer(model, 0.0)


# ---- clipping ------------------------------------------------------------------------------------


def grad_norm_of(model, batch):
    model.zero_grad()
    model(*batch).loss.backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


@pytest.mark.parametrize("clip", [0.05, None, 1e6])
def test_clipping_logs_the_norm_before_clipping_and_scales_the_step(clip):
    batches = fixed_batches(1)
    model = tiny_model()
    expected_norm = grad_norm_of(model, batches[0])
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # step = -grad: the update shows the gradient used
    history = quiet_train(model, batches, 1, optimizer=opt, clip_norm=clip)
    assert history.grad_norm[0] == pytest.approx(expected_norm, rel=1e-5)
    scale = 1.0 if clip is None or expected_norm <= clip else clip / (expected_norm + 1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), scale * grads[n], rtol=1e-4, atol=1e-7)
    update = torch.linalg.vector_norm(torch.stack([(before[n] - p.detach()).norm()
                                                   for n, p in model.named_parameters()])).item()
    assert update == pytest.approx(min(expected_norm, clip or math.inf), rel=1e-4)


# ---- accumulation ------------------------------------------------------------------------------


def test_accumulating_k_micro_batches_of_b_equals_one_batch_of_k_times_b():
    k, b, steps = 4, 2, 3
    big = fixed_batches(steps, batch=k * b)
    micro = [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for x, y in big for i in range(k)]
    one, many = tiny_model(), tiny_model()
    # SGD: its step is linear in the gradient, so equal gradients give equal weights. (Adam divides
    # by sqrt(v): a gradient near 0 that differs in the last bit can move a weight by a whole lr.)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    h_one = quiet_train(one, big, steps, optimizer=sgd(one))
    h_many = quiet_train(many, micro, steps, optimizer=sgd(many), accumulation_steps=k)
    assert h_many.loss == pytest.approx(h_one.loss, abs=1e-5)
    assert h_many.grad_norm == pytest.approx(h_one.grad_norm, rel=1e-4)
    for p, q in zip(one.parameters(), many.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # and it is not trivially equal: one micro-batch alone gives another step
    alone = tiny_model()
    quiet_train(alone, micro[::k], steps, optimizer=sgd(alone))
    assert max((p - q).abs().max().item() for p, q in zip(one.parameters(), alone.parameters())) > 1e-3


# ---- non-finite values -----------------------------------------------------------------------------


def test_a_module_that_outputs_nan_is_named_with_the_step():
    batches = fixed_batches(3)
    model = tiny_model()
    calls = {"n": 0}

    def poison(module, inputs, output):  # from the third forward pass on, attention of block 1 breaks
        calls["n"] += 1
        return (output[0] * float("nan"), output[1]) if calls["n"] >= 3 else output

    model.blocks[1].attn.register_forward_hook(poison)
    with pytest.raises(NonFiniteError) as info:
        quiet_train(model, batches, 3)
    err = info.value
    assert (err.step, err.kind, err.where) == (3, "loss", "blocks.1.attn")
    assert "step 3" in str(err) and "'blocks.1.attn'" in str(err) and "learning rate" in str(err)


def test_a_non_finite_gradient_names_the_parameter_and_no_update_is_made():
    batches = fixed_batches(1)
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_with_a_bad_gradient(model, batch):
        # d/db sqrt(b^2) at b = 0 is 0/0: the loss stays finite, this bias's gradient is NaN
        return model(*batch).loss + model.blocks[1].ffn.down.bias.pow(2).sum().sqrt()

    with pytest.raises(NonFiniteError) as info:
        quiet_train(model, batches, 1, compute_loss=loss_with_a_bad_gradient)
    err = info.value
    assert (err.step, err.kind, err.where) == (1, "gradient", "blocks.1.ffn.down.bias")
    assert "'blocks.1.ffn.down.bias'" in str(err) and "backward pass" in str(err)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_non_finite_data_and_a_broken_loss_are_told_apart():
    model = nn.Sequential(nn.Linear(3, 2))
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    x[1, 2] = float("inf")
    mse = lambda m, batch: F.mse_loss(m(batch[0]), batch[1])
    with pytest.raises(NonFiniteError, match="batch itself holds a NaN") as info:
        train(model, lambda i: (x, y), 1, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              compute_loss=mse, progress=False)
    assert info.value.where is None
    ids, targets = fixed_batches(1)[0]
    lm = tiny_model()
    with pytest.raises(ValueError, match="every value of targets equals ignore_index=-100"):  # 0/0 refused
        quiet_train(lm, [(ids, torch.full_like(targets, -100))], 1)
    with pytest.raises(NonFiniteError, match="loss computation itself") as info:
        train(lm, lambda i: (ids, targets), 1, optimizer=torch.optim.SGD(lm.parameters(), lr=0.1),
              compute_loss=lambda m, batch: m(*batch).loss / 0.0, progress=False)
    assert info.value.kind == "loss" and info.value.where is None
    lm.blocks[0].ffn.up.weight.data[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="'blocks.0.ffn.up.weight' itself"):
        quiet_train(lm, [(ids, targets)], 1)


# ---- precision -----------------------------------------------------------------------------------


def test_bf16_autocast_runs_on_cpu_and_stays_close_to_fp32():
    batches = fixed_batches(3)
    dtypes = []

    def loss_recording_dtype(model, batch):
        out = model(*batch)
        dtypes.append(out.logits.dtype)
        return out.loss

    h32 = quiet_train(tiny_model(), batches, 3, compute_loss=loss_recording_dtype)
    h16 = quiet_train(tiny_model(), batches, 3, compute_loss=loss_recording_dtype, precision="bf16")
    assert dtypes == [torch.float32] * 3 + [torch.bfloat16] * 3
    assert all(math.isfinite(v) for v in h16.loss)
    assert h16.loss == pytest.approx(h32.loss, abs=0.05)  # bf16 keeps 8 bits of mantissa


def test_fp16_on_cpu_and_unknown_precisions_raise_clear_errors():
    with pytest.raises(ValueError, match="fp16 training needs a CUDA GPU.*bf16"):
        quiet_train(tiny_model(), fixed_batches(1), 1, precision="fp16")
    with pytest.raises(ValueError, match="'fp32', 'bf16' or 'fp16', got 'int8'"):
        autocast_context("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match="gradient scaler belongs to fp16"):
        quiet_train(tiny_model(), fixed_batches(1), 1, scaler=torch.amp.GradScaler("cpu"))


# ---- the loop's bookkeeping ------------------------------------------------------------------------


def test_callbacks_run_after_every_step_and_evaluation_when_asked():
    batches = fixed_batches(5)
    seen = []
    history = quiet_train(tiny_model(), batches, 5, callbacks=[lambda info: seen.append(
        (info.step, info.loss, info.lr, info.grad_norm, info.history.step[-1]))],
        evaluate=lambda m: float(m.training), eval_every=2)
    assert [s[0] for s in seen] == [1, 2, 3, 4, 5] == [s[4] for s in seen]
    assert [s[1] for s in seen] == history.loss and [s[3] for s in seen] == history.grad_norm
    assert history.eval_step == [2, 4, 5] and history.eval_value == [0.0, 0.0, 0.0]  # evaluated in eval mode


def test_time_budget_stops_early_and_history_round_trips():
    history = quiet_train(tiny_model(), fixed_batches(5), 5, time_budget=0.0)
    assert history.step == [1] and history.stopped_early
    assert History.from_dict(history.as_dict()) == history
    with pytest.raises(ValueError, match="unknown History fields"):
        History.from_dict({"steps": []})


def test_train_rejects_inconsistent_arguments():
    model, batches = tiny_model(), fixed_batches(2)
    opt = make_optimizer(model, 1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, constant_schedule())
    with pytest.raises(ValueError, match="not both"):
        quiet_train(model, batches, 1, optimizer=opt, schedule=constant_schedule(), scheduler=sched)
    with pytest.raises(ValueError, match="start_step <= steps"):
        quiet_train(model, batches, 1, optimizer=opt, start_step=2)
    with pytest.raises(ValueError, match="clip_norm must be positive"):
        quiet_train(model, batches, 1, optimizer=opt, clip_norm=0.0)
    with pytest.raises(ValueError, match="2 tensor.*not parameters of this model"):
        copy_alone = copy.deepcopy(model)  # its optimizer still holds the original's weights
        quiet_train(copy_alone, batches, 1, optimizer=torch.optim.SGD(list(model.parameters())[:2], lr=0.1))
