"""Real pretrained checkpoints into the course's :class:`~tutorial_lib.gpt.DecoderOnlyLM`.

``load_pretrained(source)`` takes a folder in Hugging Face's layout, or a model id on the
Hugging Face Hub (fetched with ``huggingface_hub`` when online), and returns the model, its
tokenizer and its :class:`~tutorial_lib.config.ModelConfig`:

* ``config.json`` becomes a ModelConfig through :func:`tutorial_lib.convert.decoder_config`
  (notebook 07's reader, which refuses what the course's model does not compute);
* the weights are read from ``model.safetensors``, or from the shards that
  ``model.safetensors.index.json`` lists. The model is first built on PyTorch's ``meta``
  device (shapes, no memory), its parameters are then allocated once in the dtype asked for,
  and each shard's tensors are copied into them one at a time, renamed by
  :func:`tutorial_lib.convert.hf_tensor_map`. Nothing from ``transformers`` runs here.
* ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``) becomes a
  :class:`~tutorial_lib.bpe.BPETokenizer`.

Before any weight is read, every shard's header is checked: a missing shard, a missing
tensor or a tensor the model has no place for is a ValueError that names them.

A safetensors file is: 8 bytes (little-endian length N), N bytes of JSON that give each
tensor's dtype, shape and byte range, then the raw bytes. :func:`read_safetensors_header`
reads the JSON part; the weights are read with the ``safetensors`` package, memory-mapped.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from .bpe import BPETokenizer, load_tokenizer
from .config import ModelConfig
from .convert import (
    check_map_covers,
    check_shape,
    check_tensor_names,
    decoder_config,
    hf_tensor_map,
    mapped_tensor,
    target_slice,
)
from .gpt import DecoderOnlyLM
from .positions import RotaryEmbedding

HUB_HOST = "huggingface.co"
# What load_pretrained fetches of a Hub repository: nothing else (no other weight formats).
HUB_FILES = ["config.json", "model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "vocab.json", "merges.txt"]
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


class Pretrained(NamedTuple):
    model: DecoderOnlyLM
    tokenizer: BPETokenizer | None  # None when the folder has no tokenizer this package reads
    config: ModelConfig


def hub_reachable(timeout: float = 3.0, host: str = HUB_HOST, port: int = 443) -> bool:
    """Whether a connection to the Hugging Face Hub opens within ``timeout`` seconds.

    False at once when ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set. The name lookup
    and the connection run in a thread that is waited for at most 2 x timeout, so an offline
    machine answers quickly whatever its resolver does.
    """
    if any(os.environ.get(flag, "").lower() in ("1", "true", "yes", "on")
           for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return False
    answer: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(2 * timeout)
    return bool(answer and answer[0])


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file, without
    reading any tensor (the file's own ``__metadata__`` entry is left out)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{path.name} is too short to be a safetensors file")
            (length,) = struct.unpack("<Q", raw)  # little-endian unsigned 64-bit
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path.name} is not a readable safetensors file: {err}") from err
    header.pop("__metadata__", None)
    return header


def checkpoint_shards(folder: str | Path) -> dict[Path, dict[str, dict]]:
    """shard path -> its header, for ``model.safetensors`` or the shards of
    ``model.safetensors.index.json``; a ValueError names a missing shard and what it holds."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{index.name} has no readable weight_map: {err}") from err
        shards = {}
        for file in sorted(set(weight_map.values())):
            if not (folder / file).is_file():
                held = sorted(name for name, f in weight_map.items() if f == file)
                raise ValueError(f"shard {file} is missing from {folder.name}; {index.name} lists it for "
                                 f"{len(held)} tensors, e.g. {', '.join(held[:3])}")
            shards[folder / file] = read_safetensors_header(folder / file)
        for name, file in weight_map.items():
            if name not in shards[folder / file]:
                raise ValueError(f"{index.name} puts {name} in {file}, but that shard does not hold it")
        return shards
    single = folder / "model.safetensors"
    if single.is_file():
        return {single: read_safetensors_header(single)}
    raise ValueError(f"{folder} has neither model.safetensors nor model.safetensors.index.json "
                     "(only safetensors checkpoints are read)")


def resolve_source(source: str | Path) -> Path:
    """A local folder, or the local copy of a Hub model id (fetched when the Hub is reachable,
    else taken from the Hugging Face cache; a ConnectionError says so when it is in neither)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{source} is a file; give the folder that holds config.json")
    name = str(source)
    if name.count("/") > 1 or name.startswith((".", "/")) or not name:
        raise ValueError(f"no folder at {name!r}, and it is not a Hub model id such as 'gpt2' or 'owner/name'")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"no folder at {name!r}; to fetch it from the Hub, install huggingface_hub") from None
    if hub_reachable():
        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    try:
        return Path(snapshot_download(name, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # huggingface_hub raises several kinds here; all mean "not cached"
        raise ConnectionError(f"cannot fetch {name!r}: the Hugging Face Hub is not reachable (no network, or "
                              "HF_HUB_OFFLINE is set), it is not in the local Hugging Face cache, and there is "
                              "no local folder of that name") from None


def _dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype must be a floating torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device) -> DecoderOnlyLM:
    """A DecoderOnlyLM built on the meta device, then given uninitialised parameters of
    ``dtype`` on ``device``, one allocation per parameter (tied matrices stay one), and its
    RoPE frequencies (a computed buffer, not a weight) in float32."""
    with torch.device("meta"):
        model = DecoderOnlyLM(cfg)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device))
            setattr(module, name, made[id(param)])
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = RotaryEmbedding(module.head_dim, module.base).inv_freq.to(device)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"tensors left on the meta device: {left}")
    return model


@torch.no_grad()
def load_pretrained(source: str | Path, *, dtype=None, device=None) -> Pretrained:
    """The model, tokenizer and ModelConfig of a local folder or a Hub model id.

    dtype: the parameters' dtype (default float32; "bf16" or torch.bfloat16 halves the memory).
    device: where the parameters live (default cpu). The model is returned in eval mode.
    """
    dtype, device = _dtype(dtype), torch.device("cpu" if device is None else device)
    folder = resolve_source(source)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json")
    hf = json.loads(config_path.read_text(encoding="utf-8"))
    cfg = decoder_config(hf)
    shards = checkpoint_shards(folder)
    shapes = {name: tuple(info["shape"]) for header in shards.values() for name, info in header.items()}
    maps = hf_tensor_map(cfg, hf["model_type"], shapes)
    check_tensor_names(maps, shapes, cfg.tie_embeddings)

    model = empty_model(cfg, dtype, device)
    check_map_covers(model, maps)
    params = dict(model.named_parameters())
    by_source: dict[str, list] = {}
    for m in maps:
        check_shape(m, target_slice(params, m), shapes[m.source])  # all before any weight is read
        by_source.setdefault(m.source, []).append(m)
    for shard in shards:  # one shard open at a time, one tensor in memory at a time
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in by_source:
                    tensor = f.get_tensor(name)
                    for m in by_source[name]:
                        target_slice(params, m).copy_(mapped_tensor(m, tensor))
    return Pretrained(model.eval(), _tokenizer(folder), cfg)


def _tokenizer(folder: Path) -> BPETokenizer | None:
    has_files = (folder / "tokenizer.json").is_file() or (folder / "vocab.json").is_file()
    if not has_files:
        return None
    try:
        return load_tokenizer(folder)
    except ValueError as err:
        warnings.warn(f"the model loaded, but its tokenizer is not one tutorial_lib.bpe reads: {err}", stacklevel=3)
        return None
