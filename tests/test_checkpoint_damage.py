"""Checkpoints lose nothing and explain every failure: a save that fails at any write, fsync
or rename leaves the previous checkpoint loadable bit for bit; every kept step is verified;
a damaged file, a damaged pointer or a model of another shape gets a ValueError that names
the file or the parameter and changes nothing."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tutorial_lib.checkpoint import checkpoint_steps, latest_step, load_checkpoint, save_checkpoint, saved_config
from tutorial_lib.config import GPT_TINY, ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.train import make_optimizer

CFG = replace(GPT_TINY, vocab_size=12, d_model=8, n_layers=1, n_heads=2, max_len=8)


def build(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    model = DecoderOnlyLM(cfg)
    opt = make_optimizer(model, 1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the optimizer now has moments to save
    return model, opt


def snapshot(model, opt):
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    return weights, moments


def equal_to(snap, model, opt) -> bool:
    weights, moments = snapshot(model, opt)
    return (weights.keys() == snap[0].keys() and all(torch.equal(weights[n], snap[0][n]) for n in weights)
            and all(torch.equal(moments[i][k], snap[1][i][k]) for i in snap[1] for k in snap[1][i]))


def advance(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)


class Faults:
    """Counts the file-system steps of a save (each file's write, fsync and rename) and makes
    the ``fail_at``-th one fail; a failing write first puts half its bytes in the file."""

    def __init__(self, fail_at=None):
        self.count, self.fail_at, self.failed = 0, fail_at, None

    def tick(self, what):
        self.count += 1
        if self.count == self.fail_at:
            self.failed = what
            return True
        return False

    def install(self, monkeypatch):
        real_replace, real_fsync, real_fdopen = os.replace, os.fsync, os.fdopen
        faults = self

        def replace_(src, dst):
            if faults.tick(f"rename to {Path(dst).name}"):
                raise OSError("rename failed (simulated)")
            real_replace(src, dst)

        def fsync_(fd):
            if faults.tick("fsync"):
                raise OSError("fsync failed (simulated)")
            real_fsync(fd)

        class TornFile:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                if faults.tick("write"):
                    self.f.write(data[: len(data) // 2])
                    raise OSError("disk full (simulated)")
                return self.f.write(data)

            def flush(self):
                self.f.flush()

            def fileno(self):
                return self.f.fileno()

        monkeypatch.setattr(os, "replace", replace_)
        monkeypatch.setattr(os, "fsync", fsync_)
        monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: TornFile(real_fdopen(fd, mode, *a, **k)))


def test_a_save_that_fails_at_any_write_leaves_the_previous_checkpoint_bit_exact(tmp_path, monkeypatch):
    # what is tested is the order of the steps, not the disk's durability: a real fsync per file
    # would make this test ten times slower on some disks
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    model, opt = build()
    counter = Faults()
    with monkeypatch.context() as patch:
        counter.install(patch)
        save_checkpoint(tmp_path / "count", model, opt, step=1)
    n_steps = counter.count
    assert n_steps >= 9, f"expected a write, an fsync and a rename for each of the 3 files, counted {n_steps}"
    for fail_at in range(1, n_steps + 1):
        folder = tmp_path / f"fail-{fail_at}"
        model, opt = build()
        save_checkpoint(folder, model, opt, step=1)
        step_1 = snapshot(model, opt)
        advance(model)
        step_2 = snapshot(model, opt)
        faults = Faults(fail_at)
        with monkeypatch.context() as patch:
            faults.install(patch)
            try:
                save_checkpoint(folder, model, opt, step=2)
            except OSError:
                pass  # the simulated failure; a failed fsync of the folder itself is ignored by design
        assert faults.failed is not None, f"step {fail_at} of the save was never reached"
        fresh, fresh_opt = build(seed=99)
        loaded = load_checkpoint(folder, fresh, fresh_opt)
        assert equal_to(step_1 if loaded.step == 1 else step_2, fresh, fresh_opt), \
            f"after a failed {faults.failed} the latest checkpoint (step {loaded.step}) is not what was saved"
        fresh, fresh_opt = build(seed=98)
        assert load_checkpoint(folder, fresh, fresh_opt, step=1).step == 1
        assert equal_to(step_1, fresh, fresh_opt), f"after a failed {faults.failed} step 1 changed"
        save_checkpoint(folder, model, opt, step=2)  # the next save completes and sweeps the debris
        assert not list(folder.glob(".*.tmp")) and checkpoint_steps(folder) == [1, 2]


def saved_three_steps(folder):
    model, opt = build()
    snaps = {}
    for step in (1, 2, 3):
        save_checkpoint(folder, model, opt, step=step, keep=3)
        snaps[step] = snapshot(model, opt)
        advance(model)
    return snaps


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


def test_every_kept_step_has_its_hashes_recorded_and_verified(tmp_path):
    saved_three_steps(tmp_path)
    recorded = json.loads((tmp_path / "latest.json").read_text())["sha256"]
    assert sorted(recorded) == sorted(f"{kind}-{s:08d}.{ext}" for s in (1, 2, 3)
                                      for kind, ext in (("model", "safetensors"), ("state", "pt")))
    damage(tmp_path / "model-00000001.safetensors", "flip")
    damage(tmp_path / "state-00000002.pt", "flip")
    model, opt = build(seed=5)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"model-00000001.safetensors is damaged.*step=N\) with N in \[2, 3\]"):
        load_checkpoint(tmp_path, model, opt, step=1)
    with pytest.raises(ValueError, match=r"state-00000002.pt is damaged.*N in \[1, 3\]"):
        load_checkpoint(tmp_path, model, opt, step=2)
    assert equal_to(before, model, opt), "a refused load changed the model or the optimizer"
    assert load_checkpoint(tmp_path, model, opt).step == 3


@pytest.mark.parametrize("kind", ["model", "state"])
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_truncated_or_overwritten_file_names_itself_and_says_to_load_another_step(tmp_path, kind, how):
    snaps = saved_three_steps(tmp_path)
    name = "model-00000003.safetensors" if kind == "model" else "state-00000003.pt"
    damage(tmp_path / name, how)
    model, opt = build(seed=5)
    with pytest.raises(ValueError, match=rf"{name} is damaged.*Load another step.*N in \[1, 2\]"):
        load_checkpoint(tmp_path, model, opt)
    assert load_checkpoint(tmp_path, model, opt, step=2).step == 2 and equal_to(snaps[2], model, opt)


@pytest.mark.parametrize("content", [b"{\"format\": 2, \"st", b"\x00\xff garbage", b"[1, 2]", b'{"format": 2}'])
def test_a_damaged_pointer_names_itself_and_every_step_still_verifies_itself(tmp_path, content):
    snaps = saved_three_steps(tmp_path)
    (tmp_path / "latest.json").write_bytes(content)
    model, opt = build(seed=5)
    with pytest.raises(ValueError, match=r"latest.json is damaged.*complete steps \[1, 2, 3\].*step=N"):
        load_checkpoint(tmp_path, model, opt)
    with pytest.raises(ValueError, match="latest.json is damaged"):
        latest_step(tmp_path)
    assert load_checkpoint(tmp_path, model, opt, step=3).step == 3 and equal_to(snaps[3], model, opt)
    # without the pointer, each weights file checks its own tensors and its state file's hash
    damage(tmp_path / "model-00000002.safetensors", "flip")
    damage(tmp_path / "state-00000001.pt", "flip")
    with pytest.raises(ValueError, match="model-00000002.safetensors is damaged"):
        load_checkpoint(tmp_path, model, opt, step=2)
    with pytest.raises(ValueError, match="state-00000001.pt is damaged"):
        load_checkpoint(tmp_path, model, opt, step=1)
    save_checkpoint(tmp_path, model, opt, step=4, keep=3)  # a new save writes a sound pointer again
    assert latest_step(tmp_path) == 4


def test_a_model_of_another_shape_is_told_what_differs_and_how_to_rebuild(tmp_path):
    model, opt = build()
    save_checkpoint(tmp_path, model, opt, step=1)
    other, other_opt = build(cfg=replace(CFG, n_layers=2, d_ff=16))
    before = snapshot(other, other_opt)
    with pytest.raises(ValueError) as info:
        load_checkpoint(tmp_path, other, other_opt)
    message = str(info.value)
    assert "parameter 'blocks.0.ffn.up.weight' has shape (32, 8) in model-00000001.safetensors but (16, 8)" in message
    assert "n_layers=1 (this model: 2)" in message and "d_ff=None (this model: 16)" in message, message
    assert "ModelConfig.from_dict(saved_config(folder))" in message
    assert equal_to(before, other, other_opt), "the refused load changed the model"
    rebuilt = DecoderOnlyLM(ModelConfig.from_dict(saved_config(tmp_path)))
    load_checkpoint(tmp_path, rebuilt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), rebuilt.state_dict().values()))


def test_an_optimizer_built_otherwise_is_refused_before_the_model_changes(tmp_path):
    model, opt = build()
    save_checkpoint(tmp_path, model, opt, step=1)
    fresh, _ = build(seed=3)
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    one_group = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"optimizer does not fit state-00000001.pt.*make_optimizer"):
        load_checkpoint(tmp_path, fresh, one_group)
    assert all(torch.equal(before[n], t) for n, t in fresh.state_dict().items())
