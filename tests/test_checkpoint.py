"""Checkpoints: a resumed run repeats the uninterrupted one bit for bit on the CPU, tied weights
survive, and a save that dies half-way leaves the previous checkpoint loadable."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tutorial_lib import checkpoint as ckpt
from tutorial_lib.checkpoint import (
    checkpoint_steps,
    latest_step,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from tutorial_lib.config import GPT_TINY
from tutorial_lib.data import lm_batch
from tutorial_lib.device import seed_everything
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.train import make_optimizer, train, warmup_cosine_schedule

ROOT = Path(__file__).resolve().parent.parent
# dropout > 0, so resuming exactly also needs torch's random state
CFG = replace(GPT_TINY, vocab_size=16, d_model=16, n_layers=2, n_heads=2, max_len=12, dropout=0.1)
STREAM = torch.randint(0, 16, (500,), generator=torch.Generator().manual_seed(3))
N = 8  # steps of the whole run; the interrupted run stops at N // 2


def build(seed):
    seed_everything(seed)
    model = DecoderOnlyLM(CFG)
    return model, make_optimizer(model, 1e-2)


def run(model, opt, data_order, steps, **kwargs):
    """A run whose batches come from a stateful generator, as most data loaders do."""
    return train(model, lambda i: lm_batch(STREAM, 4, 8, generator=data_order), steps, optimizer=opt,
                 clip_norm=0.5, progress=False, **kwargs)


def params(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path):
    schedule = warmup_cosine_schedule(2, N)
    model, opt = build(0)
    straight = run(model, opt, torch.Generator().manual_seed(1), N, schedule=schedule)
    final = params(model)

    model, opt = build(0)
    data_order = torch.Generator().manual_seed(1)
    first_half = run(model, opt, data_order, N // 2, schedule=schedule)
    save_checkpoint(tmp_path, model, opt, step=N // 2, history=first_half, generator=data_order,
                    extra={"config": CFG.to_dict()})
    del model, opt, data_order  # the "interruption": nothing survives but the files

    model, opt = build(123)  # another seed: everything must come from the checkpoint
    data_order = torch.Generator().manual_seed(999)
    state = load_checkpoint(tmp_path, model, opt, generator=data_order)
    assert state.step == N // 2 and state.extra["config"]["d_model"] == CFG.d_model
    resumed = run(model, opt, data_order, N, schedule=schedule, start_step=state.step, history=state.history)

    assert resumed.step == straight.step == list(range(1, N + 1))
    assert resumed.loss == straight.loss  # exactly, not approximately
    assert resumed.lr == straight.lr and resumed.grad_norm == straight.grad_norm
    assert all(torch.equal(final[n], p) for n, p in params(model).items())


def test_resume_with_a_scheduler_object_and_accumulation_is_exact(tmp_path):
    def fresh(seed):
        model, opt = build(seed)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine_schedule(2, N))

    model, opt, sched = fresh(0)
    straight = run(model, opt, torch.Generator().manual_seed(1), N, scheduler=sched, accumulation_steps=2)

    model, opt, sched = fresh(0)
    data_order = torch.Generator().manual_seed(1)
    half = run(model, opt, data_order, N // 2, scheduler=sched, accumulation_steps=2)
    save_checkpoint(tmp_path, model, opt, step=N // 2, scheduler=sched, history=half, generator=data_order)
    model, opt, sched = fresh(5)
    data_order = torch.Generator()
    state = load_checkpoint(tmp_path, model, opt, scheduler=sched, generator=data_order)
    resumed = run(model, opt, data_order, N, scheduler=sched, accumulation_steps=2, start_step=state.step,
                  history=state.history)
    assert resumed.loss == straight.loss and resumed.lr == straight.lr


def test_without_the_random_states_the_resumed_run_differs(tmp_path):
    """The control that shows the exact test can fail: dropout then draws other masks."""
    model, opt = build(0)
    data_order = torch.Generator().manual_seed(1)
    straight = run(model, opt, data_order, N)
    model, opt = build(0)
    data_order = torch.Generator().manual_seed(1)
    half = run(model, opt, data_order, N // 2)
    save_checkpoint(tmp_path, model, opt, step=N // 2, history=half, generator=data_order)
    model, opt = build(0)
    state = load_checkpoint(tmp_path, model, opt, restore_rng=False)
    torch.manual_seed(77)
    resumed = run(model, opt, torch.Generator().manual_seed(1), N, start_step=state.step, history=state.history)
    assert resumed.loss[: N // 2] == straight.loss[: N // 2]
    assert resumed.loss[N // 2:] != straight.loss[N // 2:]


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    model, _ = build(0)
    assert model.head.weight is model.embed.tokens.weight
    path = save_checkpoint(tmp_path, model, step=0)
    with safe_open(path, framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "embed.tokens.weight" in keys and "head.weight" not in keys
    assert json.loads(meta["aliases"]) == {"head.weight": "embed.tokens.weight"} and meta["step"] == "0"
    fresh, _ = build(1)
    load_checkpoint(tmp_path, fresh)
    assert fresh.head.weight is fresh.embed.tokens.weight
    assert all(torch.equal(model.state_dict()[n], p) for n, p in fresh.state_dict().items())


def test_rng_state_round_trip():
    generator = torch.Generator().manual_seed(4)
    state = rng_state(generator)
    draws = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())
    set_rng_state(state, generator)
    assert (random.random(), np.random.rand(), torch.rand(1).item(),
            torch.rand(1, generator=generator).item()) == draws


# ---- crashes and damage --------------------------------------------------------------------------


def saved_twice(folder, fail_on_call=None, monkeypatch=None):
    """Save step 1, then try to save step 2 with the k-th os.replace failing."""
    model, opt = build(0)
    save_checkpoint(folder, model, opt, step=1)
    step_1 = params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if fail_on_call is not None:
        real_replace, calls = os.replace, {"n": 0}

        def failing_replace(src, dst):
            calls["n"] += 1
            if calls["n"] == fail_on_call:
                raise OSError("disk full (simulated)")
            real_replace(src, dst)

        monkeypatch.setattr(ckpt.os, "replace", failing_replace)
        with pytest.raises(OSError, match="simulated"):
            save_checkpoint(folder, model, opt, step=2)
        monkeypatch.undo()
    return step_1


@pytest.mark.parametrize("fail_on_call", [1, 2, 3], ids=["weights", "state", "pointer"])
def test_a_save_that_fails_at_any_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fail_on_call):
    step_1 = saved_twice(tmp_path, fail_on_call, monkeypatch)
    assert latest_step(tmp_path) == 1
    model, opt = build(9)
    assert load_checkpoint(tmp_path, model, opt).step == 1
    assert all(torch.equal(step_1[n], p) for n, p in params(model).items())
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file was not cleaned up"


CRASH_SCRIPT = textwrap.dedent("""
    import resource, signal, sys, torch
    from tutorial_lib.checkpoint import save_checkpoint
    from tutorial_lib.gpt import DecoderOnlyLM
    from tutorial_lib.config import GPT_TINY
    from dataclasses import replace
    folder = sys.argv[1]
    torch.manual_seed(0)
    model = DecoderOnlyLM(replace(GPT_TINY, vocab_size=16, d_model=16, n_layers=2, n_heads=2, max_len=12))
    save_checkpoint(folder, model, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    # from now on no file may grow past 4 kB: the kernel kills the process (SIGXFSZ, which Python
    # ignores by default, so put back the default action) in the middle of writing the weights,
    # as a power cut or an out-of-memory kill would: no except or finally block runs
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    save_checkpoint(folder, model, step=2)
    print("not reached")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses RLIMIT_FSIZE/SIGXFSZ (Linux)")
def test_a_process_killed_mid_write_leaves_a_loadable_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGXFSZ and "not reached" not in done.stdout, done.stderr
    partial = list(tmp_path.glob(".*.tmp"))
    assert len(partial) == 1 and partial[0].stat().st_size == 4096  # the write really was cut
    assert latest_step(tmp_path) == 1 and checkpoint_steps(tmp_path) == [1]
    torch.manual_seed(0)
    original = DecoderOnlyLM(replace(CFG, dropout=0.0))
    model, _ = build(5)
    load_checkpoint(tmp_path, model)
    assert all(torch.equal(original.state_dict()[n], p) for n, p in params(model).items())
    save_checkpoint(tmp_path, model, step=2)  # the next save sweeps the debris away
    assert not list(tmp_path.glob(".*.tmp")) and checkpoint_steps(tmp_path) == [1, 2]


def test_a_damaged_file_is_reported_not_loaded(tmp_path):
    model, opt = build(0)
    path = save_checkpoint(tmp_path, model, opt, step=3)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model-00000003.safetensors is damaged"):
        load_checkpoint(tmp_path, model)


def test_keep_prunes_old_checkpoints_and_an_older_step_can_be_loaded(tmp_path):
    model, opt = build(0)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, model, opt, step=step, keep=2)
    assert checkpoint_steps(tmp_path) == [3, 4] and latest_step(tmp_path) == 4
    assert load_checkpoint(tmp_path, model, opt, step=3).step == 3
    with pytest.raises(ValueError, match=r"no complete checkpoint of step 1; the folder holds steps \[3, 4\]"):
        load_checkpoint(tmp_path, model, step=1)


def test_clear_errors(tmp_path):
    model, opt = build(0)
    with pytest.raises(ValueError, match="no checkpoint here"):
        load_checkpoint(tmp_path, model)
    save_checkpoint(tmp_path, model, step=0)
    with pytest.raises(ValueError, match="saved without optimizer state"):
        load_checkpoint(tmp_path, model, opt)
    with pytest.raises(ValueError, match="data-order generator was given"):
        load_checkpoint(tmp_path, model, generator=torch.Generator())
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_checkpoint(tmp_path, model, step=-1)
    other = DecoderOnlyLM(replace(CFG, d_model=32))
    with pytest.raises(ValueError, match=r"parameter 'embed.tokens.weight' has shape \(16, 16\) in "
                                         r"model-00000000.safetensors but \(16, 32\) in this model.*"
                                         r"saved_config.*d_model=16 \(this model: 32\)"):
        load_checkpoint(tmp_path, other)
