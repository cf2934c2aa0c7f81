"""Device choice and seeding, in one place, so no notebook hides state."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from .checks import check_count


def pick_device(prefer: str | None = None) -> torch.device:
    """Return ``cuda`` if available, else ``mps`` (Apple GPUs), else ``cpu``.

    ``prefer`` forces one of them (``"cpu"`` is handy for exact, repeatable runs); asking for
    a device this machine does not have is a ``ValueError``.
    """
    available = {
        "cuda": torch.cuda.is_available(),
        "mps": bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available(),
        "cpu": True,
    }
    if prefer is not None:
        if prefer not in available:
            raise ValueError(f"prefer must be one of {sorted(available)}, got {prefer!r}")
        if not available[prefer]:
            raise ValueError(f"device {prefer!r} was asked for but is not available here")
        return torch.device(prefer)
    for name in ("cuda", "mps", "cpu"):
        if available[name]:
            return torch.device(name)
    raise AssertionError("unreachable: cpu is always available")


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and PyTorch (CPU and every GPU) from one integer.

    Returns a fresh CPU ``torch.Generator`` seeded the same way, for code that takes an
    explicit generator (sampling, data order).
    """
    check_count("seed", seed, 0)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    os.environ["PYTHONHASHSEED"] = str(seed)  # for subprocesses started from here
    return torch.Generator().manual_seed(seed)


def describe(device: torch.device) -> str:
    """One line saying what will run the computations and, on a GPU, in which precision
    :func:`default_precision` trains there (the CPU's line names no precision: it is fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        precision = PRECISION_NAMES[default_precision(device)]
        return (f"cuda ({props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                f"{props.major}.{props.minor}), {precision}, torch {torch.__version__}")
    if device.type == "mps":
        return f"mps (Apple GPU), {PRECISION_NAMES[default_precision(device)]}, torch {torch.__version__}"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''}), torch {torch.__version__}"


def pick_setting(cpu: dict, gpu: dict, device: torch.device | None = None) -> dict:
    """The setting a notebook should use here: ``gpu`` on a CUDA device, ``cpu`` elsewhere.

    Training notebooks keep a small setting that runs in about two minutes on a 2-core CPU and
    a bigger one (model size, steps) for a GPU; this picks by itself. Both dicts must have the
    same keys.
    """
    if set(cpu) != set(gpu):
        raise ValueError(f"cpu and gpu settings must have the same keys, got {sorted(cpu)} and {sorted(gpu)}")
    device = pick_device() if device is None else torch.device(device)
    return dict(gpu if device.type == "cuda" else cpu)


def has_native_bf16(device: torch.device) -> bool:
    """Whether this CUDA GPU computes in bf16 in hardware: compute capability 8.0 or newer (A100,
    RTX 30xx and later, L4, H100) or an AMD GPU. A T4 (7.5, Colab's free GPU) or a V100 (7.0) only
    emulates it, much more slowly than fp16, although ``torch.cuda.is_bf16_supported()`` (which
    counts emulation) says True there."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device)[0] >= 8


def default_precision(device: torch.device) -> str:
    """The precision to train in here: "bf16" on a CUDA GPU with bf16 in hardware
    (:func:`has_native_bf16`), "fp16" on an older one such as Colab's T4 (``tutorial_lib.train``
    then scales the loss with a ``torch.amp.GradScaler``), "fp32" on a CPU (bf16 there is slower,
    not faster) or an Apple GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16" if has_native_bf16(device) else "fp16"
    return "fp32"


PRECISION_NAMES = {"bf16": "bf16 autocast", "fp16": "fp16 autocast with a gradient scaler", "fp32": "fp32"}


# Packages the notebooks need, and those only the tests need.
REQUIRED_PACKAGES = ("torch", "numpy", "matplotlib", "ipywidgets", "jupyterlab", "tqdm", "safetensors", "regex")
OPTIONAL_PACKAGES = ("transformers", "pytest", "nbval")


# Packages that run the notebook server, not the kernel: found and versioned, not imported
# (importing jupyterlab in a kernel takes about a second and checks nothing the kernel uses).
SERVER_PACKAGES = ("jupyterlab",)


def check_environment(required=REQUIRED_PACKAGES, optional=OPTIONAL_PACKAGES) -> list[tuple[str, str, str]]:
    """(package, "OK" / "FAIL" / "missing (optional)", version or reason) for every package."""
    from importlib import import_module, metadata, util

    rows = []
    for names, missing in ((required, "FAIL"), (optional, "missing (optional)")):
        for name in names:
            try:
                if name in SERVER_PACKAGES:
                    if util.find_spec(name) is None:
                        raise ModuleNotFoundError(f"No module named {name!r}")
                else:
                    import_module(name)
                rows.append((name, "OK", metadata.version(name)))
            except Exception as err:  # an import can fail in many ways; report, never raise
                rows.append((name, missing, f"{type(err).__name__}: {err}"[:80]))
    return rows
