"""Each notebook's GPU setting fits a Colab T4: its training cells, counted in FLOPs
(tools/t4_estimates.py), take at most 3 minutes at 30 % of the T4's peak. No GPU is needed:
the settings are read from the notebooks' JSON, and CUDA is mocked where a device is asked for."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_gpu_settings import mocked_gpu

from tutorial_lib.config import GPT_TINY
from tutorial_lib.device import default_precision, pick_setting
from tutorial_lib.params import flops_per_token
from tutorial_lib.project import notebook_number
from tutorial_lib.train import _gradient_scaler, autocast_context

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))


def load_tool():
    spec = importlib.util.spec_from_file_location("t4_estimates", ROOT / "tools" / "t4_estimates.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


t4 = load_tool()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_training_cells_of_each_notebook_fit_three_minutes_on_a_t4(path):
    found = t4.estimate(path)
    if found is None:
        assert not t4.read_settings(path), path.name
        pytest.skip(f"{path.name} picks no GPU setting: it trains only at its CPU size")
    assert found.runs, f"{path.name}: a setting is picked but the plan counts no training run"
    assert not found.unread, (f"{path.name}: the settings {found.unread} are not counted by its plan in "
                              "tools/t4_estimates.py; add the runs they size")
    assert found.seconds <= t4.BUDGET_SECONDS, (
        f"{path.name}: {found.flops:.2e} training FLOPs take about {found.seconds:.0f} s at 30 % of a T4's peak, "
        f"over the {t4.BUDGET_SECONDS:.0f} s budget: make its GPU setting smaller\n"
        + "\n".join(f"  {r.label}: {r.seconds:.0f} s ({r.precision})" for r in found.runs))


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if t4.read_settings(p)], ids=lambda p: p.name)
def test_the_notebook_picks_the_settings_that_are_counted(path):
    """The budget is about the dict that pick_setting returns on a CUDA device: the GPU one."""
    for cpu, gpu in t4.read_settings(path).values():
        with mocked_gpu("Tesla T4", (7, 5)):
            assert pick_setting(cpu=cpu, gpu=gpu) == gpu, f"{path.name}: a T4 must get the GPU setting"


def test_the_rate_is_thirty_percent_of_the_t4_datasheet_peak():
    one = t4.Run("x", 1, 0.3 * 65e12)
    assert one.seconds == pytest.approx(1.0), "65 TFLOPS fp16 (NVIDIA T4 datasheet) at 30 %"
    assert t4.Run("x", 1, 0.3 * 8.1e12, "fp32").seconds == pytest.approx(1.0), "8.1 TFLOPS fp32"
    assert t4.BUDGET_SECONDS == 180


def test_a_step_costs_six_n_per_token_plus_attention():
    cfg = GPT_TINY
    per_token = flops_per_token(cfg, context=64)["training"]
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    matrices = L * (4 * d * d + 2 * d * cfg.ffn_dim) + V * d  # attention, FFN, head
    attention = 3 * L * 2 * 2 * 64 * d  # scores and weighted sum over 64 keys, forward and backward
    assert per_token == 6 * matrices + attention, (per_token, 6 * matrices, attention)
    assert t4.lm_step(cfg, 8, 64) == 8 * 64 * per_token


def test_seq2seq_step_counts_both_stacks_and_cross_attention():
    from tutorial_lib import dates
    cfg = dates.model_config(d_model=64, n_layers=2)
    full = t4.seq2seq_step(cfg, 1, 30, 11)
    assert t4.seq2seq_step(cfg, 4, 30, 11) == 4 * full, "linear in the batch"
    enc = flops_per_token(t4.dataclasses.replace(cfg, family="encoder", src_vocab_size=None), context=30)["training"]
    assert full > 30 * enc, "more than the encoder alone"
    assert t4.seq2seq_step(cfg, 1, 60, 11) > full, "a longer source costs more"


def write_notebook(path: Path, cells: list[str]) -> Path:
    nb = {"cells": [{"cell_type": "code", "source": s, "metadata": {}, "outputs": [], "execution_count": None}
                    for s in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


SETTING_CELL = ('%matplotlib inline\nsetting = pick_setting(cpu=dict(d_model=64, n_layers=4, batch=16, block=32, '
                'steps=80),\n  gpu=dict(d_model={d}, n_layers=6, batch=64, block=128, steps={steps}), device=device)\n')


def test_an_enlarged_gpu_setting_breaks_the_budget(tmp_path):
    """The same notebook read from its JSON: the committed-size setting fits, a wider or longer one
    does not. The test above would fail on it."""
    def seconds(d, steps):
        cells = ["def broken(:\n", SETTING_CELL.format(d=d, steps=steps)]  # a cell mid-edit is skipped
        path = write_notebook(tmp_path / "08_synthetic.ipynb", cells)
        return t4.estimate(path).seconds

    fits = seconds(256, 400)
    assert fits <= t4.BUDGET_SECONDS, fits
    assert seconds(256, 1000) > t4.BUDGET_SECONDS, "2.5x the steps must break the budget"
    assert seconds(512, 400) > t4.BUDGET_SECONDS, "twice the width must break the budget"
    # three runs take `steps` steps (baseline and two broken ones), the others a fixed number
    per_step = t4.lm_step(t4.ModelConfig(family="decoder", vocab_size=t4.char_vocab(), d_model=256, n_layers=6,
                                         n_heads=4, max_len=128), 64, 128)
    added = 400 * per_step * (1 / t4.T4_PEAK["fp16"] + 2 / t4.T4_PEAK["fp32"]) / t4.UTILISATION
    assert seconds(256, 800) - fits == pytest.approx(added), "400 more steps in each of the three runs"


def test_settings_that_cannot_be_counted_are_an_error(tmp_path):
    unplanned = write_notebook(tmp_path / "99_new.ipynb", [SETTING_CELL.format(d=64, steps=10)])
    with pytest.raises(t4.SettingError, match="no plan"):
        t4.estimate(unplanned)
    renamed = write_notebook(tmp_path / "00_x.ipynb", [SETTING_CELL.format(d=64, steps=10)])
    with pytest.raises(t4.SettingError, match="reads 'setting'|lack"):  # 00's plan reads `setting`: present
        t4.estimate(renamed, {"S": ({"steps": 1}, {"steps": 2})})
    not_literal = write_notebook(tmp_path / "00_y.ipynb", ["setting = pick_setting(cpu=base, gpu=dict(steps=n))\n"])
    with pytest.raises(t4.SettingError, match="literal"):
        t4.read_settings(not_literal)
    extra = t4.estimate(write_notebook(tmp_path / "00_z.ipynb", [
        SETTING_CELL.format(d=64, steps=10), "more = pick_setting(cpu=dict(steps=1), gpu=dict(steps=9))\n"]))
    assert extra.unread == ["more"], "a setting the plan does not read is reported, so the test above fails"


@pytest.mark.parametrize("gpu, capability", [("Tesla T4", (7, 5)), ("Tesla V100-SXM2-16GB", (7, 0))])
def test_a_gpu_without_bf16_gets_fp16_autocast_and_a_gradient_scaler(gpu, capability):
    """torch.cuda.is_bf16_supported() is True on a T4 (emulation, mocked so here): it must not decide."""
    with mocked_gpu(gpu, capability):
        assert torch.cuda.is_bf16_supported(), "the mock says what torch says on a T4"
        precision = default_precision(torch.device("cuda"))
        assert precision == "fp16", f"{gpu}: {precision}"
        context = autocast_context(precision, torch.device("cuda"))
        assert context.fast_dtype == torch.float16, context.fast_dtype
        scaler = _gradient_scaler(precision, None)
        assert isinstance(scaler, torch.amp.GradScaler), "fp16 training needs a gradient scaler"


def test_gpu_check_runs_every_notebook_and_refuses_a_machine_without_a_gpu(tmp_path):
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    listed = re.search(r'^NOTEBOOKS=\$\{NOTEBOOKS:-"([0-9a-z ]+)"\}', script, flags=re.M)
    assert listed, "gpu_check.sh must list its default notebooks"
    assert listed[1].split() == [notebook_number(p.name) for p in NOTEBOOKS], "every notebook, in order"
    if torch.cuda.is_available() or shutil.which("bash") is None:
        pytest.skip("a GPU is here (or no bash): run the script itself")
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "ALLOW_CPU": "0"})
    assert done.returncode == 1 and "no CUDA GPU" in done.stderr, (done.returncode, done.stderr[-500:])
    assert not (tmp_path / "notebooks.log").exists(), "no notebook runs without a GPU"
