"""The loop that train() runs on a CUDA GPU, which reads its numbers back only every
``sync_every`` steps. It needs no GPU to be checked: the choice of loop is forced here, and a
fused AdamW (the optimizer make_optimizer builds on a GPU) runs on the CPU too. It must give the
same history, the same weights and the same NonFiniteError as the step-by-step loop."""

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_train import fixed_batches as batches
from test_train import tiny_model
from torch import nn

from tutorial_lib import gpu_loop as gpu_module
from tutorial_lib import train as train_module
from tutorial_lib.train import NonFiniteError, param_groups, train, warmup_cosine_schedule


def fused_adamw(model, lr=1e-2):
    return torch.optim.AdamW(param_groups(model, 0.1), lr=lr, fused=True)


@contextlib.contextmanager
def gpu_loop(on: bool):
    """Force the choice of loop: the GPU one (numbers read back every few steps) or the step-by-step one."""
    with mock.patch.object(gpu_module, "reads_back_rarely", return_value=on):
        yield


def run(on: bool, model, data, steps, **kwargs):
    kwargs.setdefault("optimizer", fused_adamw(model))
    with gpu_loop(on):
        return train(model, lambda i: data[i], steps, progress=False, **kwargs)


def test_the_gpu_loop_gives_the_step_by_step_loops_history_and_weights():
    data = batches(14)
    runs = {}
    for on in (False, True):
        model = tiny_model()
        history = run(on, model, data, 7, accumulation_steps=2, schedule=warmup_cosine_schedule(2, 7),
                      evaluate=lambda m: m(*data[0]).loss.item(), eval_every=2, sync_every=3)
        runs[on] = history, model
    (eager, eager_model), (gpu, gpu_model) = runs[False], runs[True]
    assert gpu.as_dict() == eager.as_dict() | {"seconds": gpu.seconds}, (
        f"histories differ:\n{eager.as_dict()}\n{gpu.as_dict()}")
    assert gpu.step == list(range(1, 8)) and gpu.eval_step == [2, 4, 6, 7]
    for (name, p), q in zip(eager_model.named_parameters(), gpu_model.parameters()):
        assert torch.equal(p, q), f"{name} differs after training in the two loops"


class Syncs:
    """Counts the ways a tensor's value reaches Python (each is a host sync on a GPU)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.patches = []
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(t, *args, **kwargs)

            self.patches.append(mock.patch.object(torch.Tensor, name, counted))
        for patch in self.patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in self.patches:
            patch.stop()


def test_the_gpu_loop_reads_back_once_per_sync_every_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))  # its forward reads no value back
    x, y = torch.randn(10, 16, 3), torch.randn(10, 16, 1)
    mse = lambda m, batch: F.mse_loss(m(batch[0]), batch[1])
    counts = {}
    for on in (False, True):
        with Syncs() as syncs:
            run(on, model, list(zip(x, y)), 10, compute_loss=mse, sync_every=4)
        counts[on] = syncs.calls
    assert counts[True] == ["tolist"] * 3, f"expected reads after steps 4, 8 and 10, got {counts[True]}"
    assert len(counts[False]) >= 10 * 3, f"the step-by-step loop reads loss, finiteness and norm: {counts[False]}"


def poisoned_model(from_call: int):
    model = tiny_model()
    calls = {"n": 0}

    def poison(module, inputs, output):  # from that forward pass on, attention of block 1 breaks
        calls["n"] += 1
        return (output[0] * float("nan"), output[1]) if calls["n"] >= from_call else output

    model.blocks[1].attn.register_forward_hook(poison)
    return model


def test_a_nan_found_later_names_the_step_and_module_and_the_weights_are_those_before_it():
    data = batches(8)
    errors, weights = {}, {}
    for on in (False, True):
        model = poisoned_model(from_call=3)
        with pytest.raises(NonFiniteError) as info:
            run(on, model, data, 8, sync_every=5)
        errors[on], weights[on] = info.value, [p.detach().clone() for p in model.parameters()]
    assert (errors[True].step, errors[True].kind, errors[True].where) == (3, "loss", "blocks.1.attn")
    assert str(errors[True]) == str(errors[False])
    assert all(torch.equal(a, b) for a, b in zip(weights[False], weights[True])), (
        "after the error the weights must be those from before step 3 in both loops")


def test_a_non_finite_gradient_is_named_and_no_update_is_made_by_it_or_after_it():
    data = batches(6)

    def loss_with_a_bad_gradient(model, batch):
        # d/db sqrt(b^2) at b = 0 is 0/0: the loss stays finite, this bias's gradient is NaN
        return model(*batch).loss + model.blocks[1].ffn.down.bias.pow(2).sum().sqrt()

    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(NonFiniteError) as info:
        run(True, model, data, 6, compute_loss=loss_with_a_bad_gradient, sync_every=4)
    err = info.value
    assert (err.step, err.kind, err.where) == (1, "gradient", "blocks.1.ffn.down.bias")
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), "an update was made"


def test_a_broken_loss_in_the_gpu_loop_is_told_apart_as_in_the_step_by_step_loop():
    data = batches(1) * 3

    def every_target_ignored(model, batch):  # a mean over no positions: 0 / 0 (the model itself refuses this)
        logits = model(batch[0]).logits  # (B, T, V)
        ignored = torch.full_like(batch[1], -100)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ignored.flatten(), ignore_index=-100)

    messages = {}
    for on in (False, True):
        with pytest.raises(NonFiniteError, match="loss computation itself") as info:
            run(on, tiny_model(), data, 3, compute_loss=every_target_ignored)
        messages[on] = str(info.value)
    assert messages[True] == messages[False] and info.value.step == 1


def test_sync_every_is_checked():
    model = tiny_model()
    with pytest.raises(ValueError, match="sync_every"):
        train(model, lambda i: None, 1, optimizer=fused_adamw(model), sync_every=0, progress=False)


def test_only_a_cuda_run_with_a_fused_optimizer_and_no_callbacks_reads_back_rarely():
    model = tiny_model()
    fused, plain = fused_adamw(model), torch.optim.AdamW(model.parameters())
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gpu_module.reads_back_rarely(cuda, fused, [])
    assert not gpu_module.reads_back_rarely(cpu, fused, [])
    assert not gpu_module.reads_back_rarely(cuda, plain, []), "a plain AdamW cannot skip an update on the GPU"
    assert not gpu_module.reads_back_rarely(cuda, fused, [print]), "callbacks read every step's numbers"


def test_with_a_gradient_scaler_an_overflowed_step_is_skipped_on_the_device_and_logged():
    """fp16's business as usual: scaled gradients that overflow skip the update (no error) and halve
    the scale; the next step updates. Run on the CPU through the loop's own step function, with a
    CPU GradScaler (fp16 autocast itself needs a GPU)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    history = train_module.History()
    ctx = train_module._Context(model, lambda m, b: m(b).sum(), "fp32", torch.device("cpu"), 1, scaler, history)
    named = list(model.named_parameters())
    loss_of = lambda batch: model(batch).sum()
    healthy = torch.ones((), dtype=torch.bool)
    huge, normal = torch.full((2, 4), 1e34), torch.randn(2, 4)  # 1e34 * 2**16 overflows float32
    before = [p.detach().clone() for p in model.parameters()]
    pending = []
    for step, batch in enumerate((huge, normal)):
        done, healthy = gpu_module.step_on_device(loss_of, lambda i, b=batch: b, step, optimizer, named, healthy,
                                                  accumulation_steps=1, clip_norm=None, scaler=scaler)
        pending.append(done)
        if step == 0:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "the overflowed step updated"
    assert bool(healthy), "an overflow under a scaler is not an error"
    assert scaler.get_scale() == 2.0**15, f"the scale should have halved once, got {scaler.get_scale()}"
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "the second step did not update"
    bar = mock.Mock()
    train_module._settle(ctx, pending, bar)
    assert history.step == [1, 2] and history.grad_norm[0] == float("inf") and history.grad_norm[1] < 1e3
