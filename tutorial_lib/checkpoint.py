"""Checkpoints that resume a run exactly, and that a crash cannot break.

A checkpoint of step N is three files in one folder::

    model-00000N.safetensors   the weights (safetensors: plain tensors, no pickled code)
    state-00000N.pt            optimizer, scheduler, gradient scaler, history, random states
    latest.json                the pointer: which step is the newest complete checkpoint

Every file is written to a temporary file in the same folder, flushed to disk (fsync) and
renamed over its final name (``os.replace``, atomic on POSIX and Windows). The pointer is
renamed last, so at every instant it names a complete pair: a save that dies half-way leaves
the previous checkpoint loadable (and at worst a stray ``.tmp`` file, removed by the next save).
The pointer also records each file's SHA-256, so a file damaged later is reported, not loaded.

Resuming exactly needs more than the weights: AdamW's moment estimates, the schedule's
position, and every random state (Python, NumPy, torch on the CPU and on each GPU, and the
generator that orders the data, when the caller has one). Dropout draws from torch's global
generator, so without it the resumed run would drop different units.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from .train import History

POINTER = "latest.json"
FORMAT = 1
_STEP_FILE = re.compile(r"^(model|state)-(\d{8})\.(safetensors|pt)$")


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` hands back besides the states it restored in place."""

    step: int  # optimiser steps done; pass it to train(..., start_step=step)
    history: History | None
    extra: dict = field(default_factory=dict)  # whatever the caller saved (e.g. a config dict)
    path: Path | None = None  # the weights file that was loaded


# ---- atomic files -------------------------------------------------------------------------------


def _fsync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable. Windows cannot open a folder; it has no need to."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of
    ``data``, never a part: temporary file in the same folder, fsync, ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- weights: safetensors, tied tensors stored once -----------------------------------------------


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def weights_to_bytes(model: nn.Module, metadata: dict[str, str] | None = None) -> bytes:
    """The model's state dict as safetensors bytes. A tied tensor (one tensor under two names,
    e.g. the token table and the output head) is stored once; the other names are recorded as
    aliases in the metadata, so loading restores every name."""
    tensors, aliases, first_name = {}, {}, {}
    for name, t in model.state_dict().items():
        key = _storage_key(t)
        if key in first_name:
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        tensors[name] = t.detach().cpu().contiguous()
    meta = dict(metadata or {})
    meta["aliases"] = json.dumps(aliases)
    return save_safetensors(tensors, metadata=meta)


def load_weights(model: nn.Module, data: bytes) -> None:
    """Load safetensors bytes written by :func:`weights_to_bytes` into ``model`` (strict: every
    name must be present and no other)."""
    tensors = load_safetensors(data)
    meta = _safetensors_metadata(data)
    for name, source in json.loads(meta.get("aliases", "{}")).items():
        tensors[name] = tensors[source]
    model.load_state_dict(tensors, strict=True)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")  # safetensors: 8-byte length, then a JSON header
    return json.loads(data[8:8 + header_len]).get("__metadata__", {})


# ---- random states ------------------------------------------------------------------------------


def rng_state(generator: torch.Generator | None = None) -> dict:
    """Every random state a training step can draw from, in types ``torch.load(weights_only=True)``
    accepts."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise ValueError(f"the checkpoint holds random states for {len(state['cuda'])} GPUs, "
                             f"this machine has {torch.cuda.device_count()}")
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None:
        if "generator" not in state:
            raise ValueError("a data-order generator was given, but the checkpoint was saved without one")
        generator.set_state(state["generator"])


# ---- save and load ------------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, scheduler=None, scaler: torch.amp.GradScaler | None = None,
                    history: History | None = None, generator: torch.Generator | None = None,
                    extra: dict | None = None, keep: int | None = 2) -> Path:
    """Save everything needed to resume after ``step`` optimiser steps; return the weights' path.

    ``generator``: the torch.Generator that orders or samples the data, if there is one. For a
    model wrapped in DistributedDataParallel, save ``model.module`` from rank 0 only.
    ``extra``: a dict of plain values (numbers, strings, lists, dicts) saved alongside, e.g. the
    model's config. ``keep``: how many checkpoints to keep (None: all); older ones are deleted
    only after the pointer has moved past them.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp"):  # left by a save that crashed
        stale.unlink(missing_ok=True)

    weights = weights_to_bytes(model, {"step": str(step)})
    buffer = io.BytesIO()
    torch.save({
        "format": FORMAT,
        "step": step,
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "history": None if history is None else history.as_dict(),
        "rng": rng_state(generator),
        "extra": dict(extra or {}),
    }, buffer)
    state = buffer.getvalue()

    model_name, state_name = f"model-{step:08d}.safetensors", f"state-{step:08d}.pt"
    atomic_write(folder / model_name, weights)
    atomic_write(folder / state_name, state)
    pointer = {"format": FORMAT, "step": step, "model": model_name, "state": state_name,
               "sha256": {model_name: _sha256(weights), state_name: _sha256(state)}}
    atomic_write(folder / POINTER, json.dumps(pointer, indent=1).encode())  # the commit point
    _fsync_folder(folder)
    if keep is not None:
        for old in checkpoint_steps(folder)[:-keep]:
            if old != step:
                (folder / f"model-{old:08d}.safetensors").unlink(missing_ok=True)
                (folder / f"state-{old:08d}.pt").unlink(missing_ok=True)
    return folder / model_name


def checkpoint_steps(folder: str | Path) -> list[int]:
    """Steps that have both files in ``folder``, oldest first (the pointer names the one to load)."""
    found: dict[int, set[str]] = {}
    for path in Path(folder).glob("*-*"):
        match = _STEP_FILE.match(path.name)
        if match:
            found.setdefault(int(match.group(2)), set()).add(match.group(1))
    return sorted(s for s, kinds in found.items() if kinds == {"model", "state"})


def latest_step(folder: str | Path) -> int | None:
    """The step the pointer names, or None when the folder holds no complete checkpoint."""
    path = Path(folder) / POINTER
    return json.loads(path.read_text())["step"] if path.is_file() else None


def _read_verified(folder: Path, name: str, expected: str | None) -> bytes:
    path = folder / name
    if not path.is_file():
        raise ValueError(f"the checkpoint file {name} is missing from the checkpoint folder")
    data = path.read_bytes()
    if expected is not None and _sha256(data) != expected:
        raise ValueError(f"the checkpoint file {name} is damaged: its SHA-256 differs from the one "
                         "recorded when it was saved. Load an earlier step (load_checkpoint(..., step=))")
    return data


def load_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    scheduler=None, scaler: torch.amp.GradScaler | None = None,
                    generator: torch.Generator | None = None, step: int | None = None,
                    restore_rng: bool = True) -> Checkpoint:
    """Restore a checkpoint into freshly built objects, in place; return its step and history.

    Loads the step the pointer names (or ``step``). Build the model, optimizer and scheduler
    exactly as for the original run first (the same config and parameter groups), then call
    this, then ``train(..., start_step=ckpt.step, history=ckpt.history)``. With
    ``restore_rng`` the Python, NumPy and torch random states (and ``generator``'s) are set to
    what they were at the save.
    """
    folder = Path(folder)
    pointer_path = folder / POINTER
    if not pointer_path.is_file():
        raise ValueError("no checkpoint here: the folder has no latest.json (nothing was saved, or "
                         "every save was interrupted before it completed)")
    pointer = json.loads(pointer_path.read_text())
    if pointer.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {pointer.get('format')!r} is not the supported {FORMAT}")
    if step is None or step == pointer["step"]:
        model_name, state_name, hashes = pointer["model"], pointer["state"], pointer["sha256"]
    else:
        if step not in checkpoint_steps(folder):
            raise ValueError(f"no complete checkpoint of step {step}; the folder holds steps "
                             f"{checkpoint_steps(folder)}")
        model_name, state_name, hashes = f"model-{step:08d}.safetensors", f"state-{step:08d}.pt", {}
    weights = _read_verified(folder, model_name, hashes.get(model_name))
    state = torch.load(io.BytesIO(_read_verified(folder, state_name, hashes.get(state_name))),
                       map_location="cpu", weights_only=True)

    load_weights(model, weights)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is None:
            continue
        if state[name] is None:
            raise ValueError(f"the checkpoint was saved without {name} state, but one was passed to restore")
        obj.load_state_dict(state[name])  # the optimizer moves its state to its parameters' device
    if restore_rng:
        set_rng_state(state["rng"], generator)
    history = None if state["history"] is None else History.from_dict(state["history"])
    return Checkpoint(state["step"], history, state["extra"], folder / model_name)
