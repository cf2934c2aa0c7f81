import random
from unittest import mock

import numpy as np
import pytest
import torch

from tutorial_lib.device import describe, pick_device, seed_everything


def test_pick_device_prefers_cuda_then_mps_then_cpu():
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.backends.mps.is_available", return_value=True):
        assert pick_device().type == "cuda"
    with mock.patch("torch.cuda.is_available", return_value=False), \
            mock.patch("torch.backends.mps.is_available", return_value=True):
        assert pick_device().type == "mps"
    with mock.patch("torch.cuda.is_available", return_value=False), \
            mock.patch("torch.backends.mps.is_available", return_value=False):
        assert pick_device().type == "cpu"


def test_pick_device_refuses_what_is_missing():
    with mock.patch("torch.cuda.is_available", return_value=False):
        with pytest.raises(ValueError, match="not available"):
            pick_device("cuda")
    with pytest.raises(ValueError, match="must be one of"):
        pick_device("tpu")
    assert pick_device("cpu").type == "cpu"
    assert describe(torch.device("cpu")).startswith("cpu (")


def test_seed_everything_makes_every_generator_repeat():
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3)

    g1 = seed_everything(123)
    first, gen_first = draw(), torch.rand(2, generator=g1)
    g2 = seed_everything(123)
    second, gen_second = draw(), torch.rand(2, generator=g2)
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2]) and torch.equal(gen_first, gen_second)
    seed_everything(124)
    assert draw()[0] != first[0]
    with pytest.raises(ValueError, match="non-negative int"):
        seed_everything(-1)


def test_pick_setting_uses_the_gpu_setting_only_on_cuda():
    from tutorial_lib.device import default_precision, pick_setting

    cpu, gpu = {"d_model": 64, "steps": 300}, {"d_model": 256, "steps": 3000}
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert pick_setting(cpu, gpu) == gpu
    with mock.patch("torch.cuda.is_available", return_value=False), \
            mock.patch("torch.backends.mps.is_available", return_value=False):
        assert pick_setting(cpu, gpu) == cpu
    assert pick_setting(cpu, gpu, device="cpu") == cpu
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
        assert default_precision(torch.device("cuda")) == "bf16", "an A100 computes in bf16"
    with mock.patch("torch.cuda.get_device_capability", return_value=(7, 5)), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True):  # emulated bf16 counts here
        assert default_precision(torch.device("cuda")) == "fp16", "a T4 only emulates bf16: fp16 with a scaler"
    assert default_precision(torch.device("cpu")) == "fp32"
    with pytest.raises(ValueError, match="same keys"):
        pick_setting({"a": 1}, {"b": 2})


def test_check_environment_reports_ok_and_fail():
    from tutorial_lib.device import check_environment

    rows = check_environment(required=("torch", "surely_not_a_package_xyz"), optional=("also_missing_abc",))
    assert rows[0][:2] == ("torch", "OK")
    assert rows[0][2] in (torch.__version__, torch.__version__.split("+")[0])
    assert rows[1][:2] == ("surely_not_a_package_xyz", "FAIL") and "ModuleNotFoundError" in rows[1][2]
    assert rows[2][1] == "missing (optional)"


def test_check_environment_finds_server_packages_without_importing_them(monkeypatch):
    import sys

    from tutorial_lib import device

    monkeypatch.setattr(device, "SERVER_PACKAGES", ("jupyterlab", "surely_not_a_server_xyz"))
    monkeypatch.delitem(sys.modules, "jupyterlab", raising=False)
    rows = device.check_environment(required=("jupyterlab", "surely_not_a_server_xyz"), optional=())
    assert rows[0][:2] == ("jupyterlab", "OK") and "jupyterlab" not in sys.modules
    assert rows[1][1] == "FAIL" and "ModuleNotFoundError" in rows[1][2]
