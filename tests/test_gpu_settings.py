"""Training notebooks pick a bigger setting by themselves on a GPU and keep the small one on a
CPU: every notebook that trains calls ``pick_setting(cpu=..., gpu=...)``, and that choice is run
here with CUDA mocked as present and as absent."""

import ast
import contextlib
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from tutorial_lib.device import PRECISION_NAMES, default_precision, describe, pick_setting
from tutorial_lib.train import _gradient_scaler, autocast_context

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def code_trees(path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            try:
                yield ast.parse(source)
            except SyntaxError:  # IPython magics are not Python; no setting is chosen there
                continue


def calls_named(path, name):
    return [node for tree in code_trees(path) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name]


def literal(node):
    """A dict(...) call or {...} display of literal values, as a dict."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
        return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    return ast.literal_eval(node)


# The training notebooks (about two minutes on a CPU), and any other notebook that chooses a setting.
def is_bigger(gpu_value, cpu_value) -> bool:
    """A larger number, or a longer list of runs (e.g. more learning rates in a sweep)."""
    if isinstance(cpu_value, bool):
        return False
    if isinstance(cpu_value, (int, float)):
        return gpu_value > cpu_value
    if isinstance(cpu_value, (tuple, list)):
        return len(gpu_value) > len(cpu_value)
    return False


TRAINING_PREFIXES = ("04_", "05_", "06_", "08_")
TRAINING = [p for p in NOTEBOOKS if p.name.startswith(TRAINING_PREFIXES) or calls_named(p, "pick_setting")]


def test_the_training_notebooks_train():
    for path in TRAINING:
        if path.name.startswith(TRAINING_PREFIXES):
            assert calls_named(path, "train"), f"{path.name} is a training notebook but never calls train(...)"


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.name)
def test_training_notebook_picks_its_setting_by_device(path):
    calls = calls_named(path, "pick_setting")
    assert calls, f"{path.name} trains but never calls pick_setting(cpu=..., gpu=...)"
    for call in calls:
        args = {kw.arg: kw.value for kw in call.keywords}
        assert "cpu" in args and "gpu" in args, "call pick_setting with cpu= and gpu= keyword dicts"
        cpu, gpu = literal(args["cpu"]), literal(args["gpu"])
        assert cpu != gpu, f"{path.name}: the GPU setting must differ from the CPU one"
        assert any(is_bigger(gpu[k], cpu[k]) for k in cpu), (
            f"{path.name}: the GPU setting should be bigger somewhere (model size, steps, batch, more runs)")
        with mock.patch("torch.cuda.is_available", return_value=True):
            assert pick_setting(cpu=cpu, gpu=gpu) == gpu
        with mock.patch("torch.cuda.is_available", return_value=False), \
                mock.patch("torch.backends.mps.is_available", return_value=False):
            assert pick_setting(cpu=cpu, gpu=gpu) == cpu


@pytest.mark.parametrize("path", [p for p in TRAINING if p.name.startswith(("00_",) + TRAINING_PREFIXES)],
                         ids=lambda p: p.name)
def test_the_main_training_run_uses_bf16_where_the_gpu_has_it(path):
    """At least one train(...) call takes its precision from default_precision(device): fp32 on a
    CPU (the committed outputs), bf16 on a GPU that supports it."""
    uses = [call for call in calls_named(path, "train")
            for kw in call.keywords if kw.arg == "precision" and isinstance(kw.value, ast.Call)
            and getattr(kw.value.func, "id", None) == "default_precision"]
    assert uses, f"{path.name}: no train(..., precision=default_precision(device)) call"


@contextlib.contextmanager
def mocked_gpu(name: str, capability: tuple[int, int], gib: float = 15.0):
    """CUDA mocked as present, with one GPU of this name and compute capability."""
    props = mock.Mock(major=capability[0], minor=capability[1], total_memory=int(gib * 2**30))
    props.name = name
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.get_device_capability", return_value=capability), \
            mock.patch("torch.cuda.get_device_properties", return_value=props), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True):  # what torch says on a T4: emulated
        yield


@pytest.mark.parametrize("gpu, capability, expected", [("Tesla T4", (7, 5), "fp16"), ("Tesla V100", (7, 0), "fp16"),
                                                        ("NVIDIA A100", (8, 0), "bf16"), ("NVIDIA L4", (8, 9), "bf16")])
def test_a_gpu_without_bf16_in_hardware_trains_in_fp16_with_a_gradient_scaler(gpu, capability, expected):
    """Colab's T4 emulates bf16 (torch.cuda.is_bf16_supported() says True there), much more slowly
    than fp16: default_precision must pick fp16 there, and train() then scales the loss."""
    with mocked_gpu(gpu, capability):
        cuda = torch.device("cuda")
        precision = default_precision(cuda)
        assert precision == expected, f"{gpu} (compute capability {capability}) should train in {expected}"
        line = describe(cuda)
        assert gpu in line and PRECISION_NAMES[expected] in line, f"the first cell should name both: {line}"
        context = autocast_context(precision, cuda)
        assert isinstance(context, torch.autocast), type(context)
        assert context.fast_dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[expected]
        scaler = _gradient_scaler(precision, None)
        if expected == "fp16":
            assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled(), "fp16 needs a gradient scaler"
        else:
            assert scaler is None, "bf16 has float32's range: no scaler"
