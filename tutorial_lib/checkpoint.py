"""Checkpoints that resume a run exactly, and that a crash cannot break.

A checkpoint of step N is two files in one folder, and the folder has one pointer::

    model-00000N.safetensors   the weights (safetensors: plain tensors, no pickled code)
    state-00000N.pt            optimizer, scheduler, gradient scaler, history, random states
    latest.json                the pointer: which step is the newest complete checkpoint

Every file is written to a temporary file in the same folder, flushed to disk (fsync) and
renamed over its final name (``os.replace``, atomic on POSIX and Windows). The pointer is
renamed last, so at every instant it names a complete pair: a save that dies half-way leaves
the previous checkpoint loadable (and at worst a stray ``.tmp`` file, removed by the next save).

Every kept step is verified when it is loaded, so a file damaged later is reported, not
loaded. The pointer records the SHA-256 of the files of every kept step; and each weights
file carries in its own metadata a SHA-256 of its tensors and the SHA-256 of its state file,
so a step stays verifiable even when the pointer itself is damaged (load it with ``step=``).
The weights file also records the model's config (when the model has one), so that a model
of another shape can be told how to rebuild itself.

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

from .checks import check_count
from .train import History

POINTER = "latest.json"
FORMAT = 2  # 2: hashes of every kept step, self-verifying weights files
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
    aliases in the metadata, so loading restores every name. The metadata also holds a digest
    of the tensors (see :func:`tensor_digest`), so the file can verify itself."""
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
    meta["tensors_sha256"] = tensor_digest(tensors)
    return save_safetensors(tensors, metadata=meta)


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``tensors``, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())  # the raw bytes, whatever the dtype
    return digest.hexdigest()


def read_weights(data: bytes, name: str = "the weights file", *,
                 verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors bytes written by :func:`weights_to_bytes`: (tensors with every alias
    restored, metadata). Raises ValueError naming ``name`` when the bytes cannot be parsed or
    (with ``verify``) when the tensors differ from the digest in the metadata."""
    try:
        tensors = load_safetensors(data)
        meta = _safetensors_metadata(data)
        aliases = json.loads(meta.get("aliases", "{}"))
    except Exception as err:  # a truncated or overwritten file fails in the parser, in many ways
        raise ValueError(f"the checkpoint file {name} is damaged: it cannot be read as safetensors "
                         f"({type(err).__name__}: {err})") from None
    digest = meta.get("tensors_sha256")
    if verify and digest is not None and tensor_digest(tensors) != digest:
        raise ValueError(f"the checkpoint file {name} is damaged: its tensors differ from the digest recorded "
                         "when it was saved")
    for alias, source in aliases.items():
        tensors[alias] = tensors[source]
    return tensors, meta


def check_weights_fit(model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, str],
                      name: str = "the checkpoint") -> None:
    """Raise ValueError, before anything is loaded, unless ``tensors`` have exactly the names
    and shapes of ``model``'s state dict; the message names the first mismatch and, when the
    checkpoint recorded a config, the fields in which it differs from the model's."""
    ours = model.state_dict()
    problem = None
    for key, t in ours.items():
        if key not in tensors:
            problem = f"{name} has no parameter {key!r} (shape {tuple(t.shape)}) that this model has"
        elif tuple(tensors[key].shape) != tuple(t.shape):
            problem = (f"parameter {key!r} has shape {tuple(tensors[key].shape)} in {name} but "
                       f"{tuple(t.shape)} in this model")
        if problem:
            break
    if problem is None:
        extra = sorted(set(tensors) - set(ours))
        if not extra:
            return
        problem = f"{name} has parameters this model lacks: {extra[:4]}{' ...' if len(extra) > 4 else ''}"
    raise ValueError(f"the checkpoint does not fit this model: {problem}. {_rebuild_hint(model, meta)}")


def _rebuild_hint(model: nn.Module, meta: dict[str, str]) -> str:
    if "config" not in meta:
        return "Build the model exactly as for the saved run (the same config), then load"
    saved = json.loads(meta["config"])
    ours = model.cfg.to_dict() if hasattr(getattr(model, "cfg", None), "to_dict") else {}
    differ = [f"{k}={saved[k]!r} (this model: {ours[k]!r})" for k in saved if k in ours and saved[k] != ours[k]]
    where = f"; the saved config differs in {', '.join(differ)}" if differ else ""
    return ("Rebuild the model from the config saved in the checkpoint: "
            f"ModelConfig.from_dict(saved_config(folder)){where}")


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


def _names(step: int) -> tuple[str, str]:
    return f"model-{step:08d}.safetensors", f"state-{step:08d}.pt"


def save_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, scheduler=None, scaler: torch.amp.GradScaler | None = None,
                    history: History | None = None, generator: torch.Generator | None = None,
                    extra: dict | None = None, keep: int | None = 2) -> Path:
    """Save everything needed to resume after ``step`` optimiser steps; return the weights' path.

    ``generator``: the torch.Generator that orders or samples the data, if there is one. For a
    model wrapped in DistributedDataParallel, save ``model.module`` from rank 0 only.
    ``extra``: a dict of plain values (numbers, strings, lists, dicts) saved alongside.
    The model's own config (``model.cfg``, when it has one) is saved in any case (see
    :func:`saved_config`). ``keep``: how many checkpoints to keep (None: all); older ones are
    deleted only after the pointer has moved past them.
    """
    check_count("step", step, 0)
    check_count("keep", keep, optional=True)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp"):  # left by a save that crashed
        stale.unlink(missing_ok=True)

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
    meta = {"step": str(step), "state_sha256": _sha256(state)}  # the state file's hash travels with the weights
    if hasattr(getattr(model, "cfg", None), "to_dict"):
        meta["config"] = json.dumps(model.cfg.to_dict())
    weights = weights_to_bytes(model, meta)

    model_name, state_name = _names(step)
    previous = _read_pointer(folder, strict=False)  # the hashes of the steps saved before
    atomic_write(folder / model_name, weights)
    atomic_write(folder / state_name, state)
    steps = checkpoint_steps(folder)
    kept = steps if keep is None else [s for s in steps if s == step or s in steps[-keep:]]
    hashes = {name: h for name, h in (previous or {}).get("sha256", {}).items()
              if _STEP_FILE.match(name) and int(_STEP_FILE.match(name).group(2)) in kept}
    hashes |= {model_name: _sha256(weights), state_name: _sha256(state)}
    pointer = {"format": FORMAT, "step": step, "model": model_name, "state": state_name, "sha256": hashes}
    atomic_write(folder / POINTER, json.dumps(pointer, indent=1).encode())  # the commit point
    _fsync_folder(folder)
    for old in sorted(set(steps) - set(kept)):
        for name in _names(old):
            (folder / name).unlink(missing_ok=True)
    return folder / model_name


def checkpoint_steps(folder: str | Path) -> list[int]:
    """Steps that have both files in ``folder``, oldest first (the pointer names the one to load)."""
    found: dict[int, set[str]] = {}
    for path in Path(folder).glob("*-*"):
        match = _STEP_FILE.match(path.name)
        if match:
            found.setdefault(int(match.group(2)), set()).add(match.group(1))
    return sorted(s for s, kinds in found.items() if kinds == {"model", "state"})


def _read_pointer(folder: Path, strict: bool = True) -> dict | None:
    """The pointer's content; None when there is none. A damaged pointer raises ValueError
    (``strict``) or reads as None."""
    path = folder / POINTER
    if not path.is_file():
        return None
    try:
        pointer = json.loads(path.read_text())
        if pointer.get("format") != FORMAT:
            problem = f"it is of format {pointer.get('format')!r}, this tutorial_lib reads format {FORMAT}"
        elif not (isinstance(pointer.get("step"), int) and isinstance(pointer.get("sha256"), dict)):
            problem = "it lacks the step or the hashes"
        else:
            return pointer
    except (ValueError, UnicodeDecodeError, AttributeError) as err:
        problem = f"it is not a JSON object ({type(err).__name__}: {err})"
    if not strict:
        return None
    raise ValueError(f"the checkpoint pointer {path} is damaged: {problem}. The folder holds the complete steps "
                     f"{checkpoint_steps(folder)}; load one of them by number: load_checkpoint(folder, model, ..., "
                     "step=N) (each step verifies itself without the pointer)")


def latest_step(folder: str | Path) -> int | None:
    """The step the pointer names, or None when the folder holds no complete checkpoint."""
    pointer = _read_pointer(Path(folder))
    return None if pointer is None else pointer["step"]


def _read_file(folder: Path, name: str, expected: str | None, other_steps: list[int]) -> bytes:
    path = folder / name
    if not path.is_file():
        raise ValueError(f"the checkpoint file {name} is missing from {folder}")
    data = path.read_bytes()
    if expected is not None and _sha256(data) != expected:
        raise ValueError(f"the checkpoint file {name} is damaged: its SHA-256 differs from the one recorded when "
                         f"it was saved. {_other_steps_hint(other_steps)}")
    return data


def _other_steps_hint(other_steps: list[int]) -> str:
    if not other_steps:
        return "No other step is kept in this folder"
    return f"Load another step instead: load_checkpoint(folder, model, ..., step=N) with N in {other_steps}"


def saved_config(folder: str | Path, step: int | None = None) -> dict | None:
    """The model config (``ModelConfig.to_dict()``) a checkpoint was saved with, or None when
    its model had none. Rebuild a model with ``DecoderOnlyLM(ModelConfig.from_dict(...))``."""
    folder = Path(folder)
    step, recorded = _resolve_step(folder, step)
    name = _names(step)[0]
    data = _read_file(folder, name, recorded.get(name), [])
    _, meta = read_weights(data, name)
    return json.loads(meta["config"]) if "config" in meta else None


def _resolve_step(folder: Path, step: int | None) -> tuple[int, dict[str, str]]:
    """The step to load and the hashes the pointer records (empty when it cannot be read and
    the step was given by number)."""
    if step is None:
        pointer = _read_pointer(folder)
        if pointer is None:
            raise ValueError(f"no checkpoint here: {folder} has no {POINTER} (nothing was saved, or every save was "
                             "interrupted before it completed)")
        return pointer["step"], pointer["sha256"]
    check_count("step", step, 0, optional=True)  # None (the latest) is resolved above
    if step not in checkpoint_steps(folder):
        raise ValueError(f"no complete checkpoint of step {step}; the folder holds steps {checkpoint_steps(folder)}")
    pointer = _read_pointer(folder, strict=False)
    return step, {} if pointer is None else pointer["sha256"]


def _check_state_fits(state: dict, name: str, objects: dict, generator) -> None:
    """Refuse, before anything is changed, states that are missing or shaped for other objects."""
    for key, obj in objects.items():
        if obj is None:
            continue
        if state[key] is None:
            raise ValueError(f"the checkpoint was saved without {key} state, but one was passed to restore")
        if key == "optimizer":
            saved = [len(g["params"]) for g in state[key]["param_groups"]]
            ours = [len(g["params"]) for g in obj.param_groups]
            if saved != ours:
                raise ValueError(f"the optimizer does not fit {name}: its parameter groups hold {ours} tensors, the "
                                 f"saved ones {saved}; build it as for the saved run (e.g. make_optimizer(model, lr))")
    if generator is not None and "generator" not in state["rng"]:
        raise ValueError("a data-order generator was given, but the checkpoint was saved without one")


def load_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    scheduler=None, scaler: torch.amp.GradScaler | None = None,
                    generator: torch.Generator | None = None, step: int | None = None,
                    restore_rng: bool = True) -> Checkpoint:
    """Restore a checkpoint into freshly built objects, in place; return its step and history.

    Loads the step the pointer names (or ``step``). Build the model, optimizer and scheduler
    exactly as for the original run first (the same config and parameter groups), then call
    this, then ``train(..., start_step=ckpt.step, history=ckpt.history)``. With
    ``restore_rng`` the Python, NumPy and torch random states (and ``generator``'s) are set to
    what they were at the save. Both files are verified and checked against the objects
    before anything is changed: a damaged file, a damaged pointer or a model of another shape
    gives a ValueError that names the file or the parameter, and leaves the objects as they were.
    """
    folder = Path(folder)
    step, recorded = _resolve_step(folder, step)
    model_name, state_name = _names(step)
    others = [s for s in checkpoint_steps(folder) if s != step]
    weights = _read_file(folder, model_name, recorded.get(model_name), others)
    try:
        # a file whose SHA-256 the pointer recorded is verified already; otherwise it verifies itself
        tensors, meta = read_weights(weights, model_name, verify=model_name not in recorded)
    except ValueError as err:
        raise ValueError(f"{err}. {_other_steps_hint(others)}") from None
    state_bytes = _read_file(folder, state_name, recorded.get(state_name) or meta.get("state_sha256"), others)
    try:
        state = torch.load(io.BytesIO(state_bytes), map_location="cpu", weights_only=True)
    except Exception as err:  # only reachable when no hash was recorded for the file
        raise ValueError(f"the checkpoint file {state_name} is damaged: it cannot be read ({type(err).__name__}: "
                         f"{err}). {_other_steps_hint(others)}") from None
    check_weights_fit(model, tensors, meta, model_name)
    _check_state_fits(state, state_name, {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler},
                      generator if restore_rng else None)

    model.load_state_dict(tensors, strict=True)
    for key, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            obj.load_state_dict(state[key])  # the optimizer moves its state to its parameters' device
    if restore_rng:
        set_rng_state(state["rng"], generator)
    history = None if state["history"] is None else History.from_dict(state["history"])
    return Checkpoint(state["step"], history, state["extra"], folder / model_name)
