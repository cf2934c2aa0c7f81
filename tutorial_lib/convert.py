"""Copying weights between tutorial_lib models and other implementations: PyTorch's
``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` / ``nn.Transformer``, and
Hugging Face's BERT layer and decoder-only models (GPT-2 and the LLaMA family). Tests use
these to check our models against independent code. :func:`hf_tensor_map` is the one table
of where a Hugging Face checkpoint's tensors go in ``DecoderOnlyLM``;
:mod:`tutorial_lib.pretrained` reads checkpoint files with it (``load_pretrained("gpt2")``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .config import ModelConfig
from .gpt import DecoderOnlyLM
from .hf_config import DECODER_TYPES, decoder_config
from .layers import FeedForward, TransformerBlock
from .positions import interleaved_to_half_split
from .transformer import DecoderLayer, EncoderDecoder


def _copy(dst: Tensor, src: Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def _copy_norm(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    _copy(ours.weight, theirs.weight, f"{what}.weight")
    if getattr(ours, "bias", None) is not None:
        _copy(ours.bias, theirs.bias, f"{what}.bias")


def _copy_torch_mha(ours: MultiHeadAttention, theirs: nn.MultiheadAttention, what: str) -> None:
    _copy(ours.qkv.weight, theirs.in_proj_weight, f"{what}.in_proj_weight")  # same [Q; K; V] layout
    _copy(ours.out.weight, theirs.out_proj.weight, f"{what}.out_proj.weight")
    if ours.qkv.bias is not None:
        _copy(ours.qkv.bias, theirs.in_proj_bias, f"{what}.in_proj_bias")
    if ours.out.bias is not None:
        _copy(ours.out.bias, theirs.out_proj.bias, f"{what}.out_proj.bias")


def _copy_torch_ffn(ours: FeedForward, linear1: nn.Linear, linear2: nn.Linear, what: str) -> None:
    for dst, src, name in ((ours.up, linear1, "linear1"), (ours.down, linear2, "linear2")):
        _copy(dst.weight, src.weight, f"{what}.{name}.weight")
        if dst.bias is not None:
            _copy(dst.bias, src.bias, f"{what}.{name}.bias")


@torch.no_grad()
def copy_from_torch_encoder_layer(ours: TransformerBlock, theirs: nn.TransformerEncoderLayer) -> None:
    """Copy an ``nn.TransformerEncoderLayer``'s weights into our encoder layer."""
    _copy_torch_mha(ours.attn, theirs.self_attn, "self_attn")
    _copy_torch_ffn(ours.ffn, theirs.linear1, theirs.linear2, "ffn")
    _copy_norm(ours.attn_sublayer.norm, theirs.norm1, "norm1")
    _copy_norm(ours.ffn_sublayer.norm, theirs.norm2, "norm2")


@torch.no_grad()
def copy_from_torch_decoder_layer(ours: DecoderLayer, theirs: nn.TransformerDecoderLayer) -> None:
    """Copy an ``nn.TransformerDecoderLayer``'s weights into our decoder layer."""
    _copy_torch_mha(ours.self_attn, theirs.self_attn, "self_attn")
    _copy_torch_mha(ours.cross_attn, theirs.multihead_attn, "multihead_attn")
    _copy_torch_ffn(ours.ffn, theirs.linear1, theirs.linear2, "ffn")
    _copy_norm(ours.self_sublayer.norm, theirs.norm1, "norm1")
    _copy_norm(ours.cross_sublayer.norm, theirs.norm2, "norm2")
    _copy_norm(ours.ffn_sublayer.norm, theirs.norm3, "norm3")


@torch.no_grad()
def copy_from_torch_transformer(ours: EncoderDecoder, theirs: nn.Transformer) -> None:
    """Copy ``nn.Transformer``'s encoder and decoder stacks (it has no embeddings or output head).

    ``nn.Transformer`` always ends both stacks with a LayerNorm, also for post-LN layers, so
    our config needs ``final_norm=True`` to match it.
    """
    if len(ours.encoder.layers) != len(theirs.encoder.layers) or len(ours.decoder.layers) != len(theirs.decoder.layers):
        raise ValueError("the two models have different numbers of layers")
    for mine, other in zip(ours.encoder.layers, theirs.encoder.layers):
        copy_from_torch_encoder_layer(mine, other)
    for mine, other in zip(ours.decoder.layers, theirs.decoder.layers):
        copy_from_torch_decoder_layer(mine, other)
    for mine, other, what in ((ours.encoder.final_norm, theirs.encoder.norm, "encoder.norm"),
                              (ours.decoder.final_norm, theirs.decoder.norm, "decoder.norm")):
        if isinstance(mine, nn.Identity) or other is None:
            raise ValueError(f"{what}: nn.Transformer has a final norm; build ours with final_norm=True")
        _copy_norm(mine, other, what)


@torch.no_grad()
def copy_from_bert_layer(ours: TransformerBlock, bert_layer: nn.Module) -> None:
    """Copy a Hugging Face ``BertLayer`` (post-LN, GELU) into our encoder layer."""
    attn = bert_layer.attention
    _copy(ours.attn.qkv.weight, torch.cat([attn.self.query.weight, attn.self.key.weight, attn.self.value.weight]),
          "attention.self.{query,key,value}.weight")
    _copy(ours.attn.qkv.bias, torch.cat([attn.self.query.bias, attn.self.key.bias, attn.self.value.bias]),
          "attention.self.{query,key,value}.bias")
    _copy(ours.attn.out.weight, attn.output.dense.weight, "attention.output.dense.weight")
    _copy(ours.attn.out.bias, attn.output.dense.bias, "attention.output.dense.bias")
    _copy_norm(ours.attn_sublayer.norm, attn.output.LayerNorm, "attention.output.LayerNorm")
    _copy_torch_ffn(ours.ffn, bert_layer.intermediate.dense, bert_layer.output.dense, "intermediate/output")
    _copy_norm(ours.ffn_sublayer.norm, bert_layer.output.LayerNorm, "output.LayerNorm")


# ---- Hugging Face decoder-only models ---------------------------------------------------------
# One table says where every tensor of a Hugging Face checkpoint goes in DecoderOnlyLM. The
# in-memory copy below (from_hf_model) and tutorial_lib.pretrained (checkpoint files, shard by
# shard) both read it. Their config.json is read by tutorial_lib.hf_config.decoder_config (the
# loading verdict), whose DECODER_TYPES are the model types with a map here.


class TensorMap(NamedTuple):
    """Where one checkpoint tensor goes: ``source`` (its name in the checkpoint) fills
    ``target`` (a name in ``DecoderOnlyLM.state_dict()``), or only the target's rows ``rows``
    (one part of a fused matrix such as [Q; K; V]); ``source_rows`` takes only those rows of
    the source (Phi-3's fused [gate; up]); ``transpose`` for GPT-2's Conv1D, which stores
    (in, out) where nn.Linear stores (out, in); ``plus_one`` for Gemma, whose norms store
    w - 1 and multiply by 1 + w; ``rope_heads`` for the query and key projections of a GGUF
    file, whose rows llama.cpp stored in the interleaved RoPE layout, head by head (the
    number of heads of that projection: the key/value heads for ``attn_k``)."""

    source: str
    target: str
    rows: tuple[int, int] | None = None
    source_rows: tuple[int, int] | None = None
    transpose: bool = False
    plus_one: bool = False
    rope_heads: int = 0


def _gpt2_map(cfg: ModelConfig, prefix: str) -> list[TensorMap]:
    maps = [TensorMap(prefix + "wte.weight", "embed.tokens.weight"),
            TensorMap(prefix + "wpe.weight", "embed.positions.embedding.weight"),
            TensorMap(prefix + "ln_f.weight", "final_norm.weight"), TensorMap(prefix + "ln_f.bias", "final_norm.bias")]
    for i in range(cfg.n_layers):
        h, b = f"{prefix}h.{i}.", f"blocks.{i}."
        for theirs, ours in (("ln_1", "attn_sublayer.norm"), ("ln_2", "ffn_sublayer.norm")):
            maps += [TensorMap(h + theirs + ".weight", b + ours + ".weight"),
                     TensorMap(h + theirs + ".bias", b + ours + ".bias")]
        # Conv1D weights are (in, out): transposed into nn.Linear's (out, in); c_attn is already [Q; K; V]
        for theirs, ours in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.out"), ("mlp.c_fc", "ffn.up"),
                             ("mlp.c_proj", "ffn.down")):
            maps += [TensorMap(h + theirs + ".weight", b + ours + ".weight", transpose=True),
                     TensorMap(h + theirs + ".bias", b + ours + ".bias")]
    return maps


def _llama_map(cfg: ModelConfig, model_type: str) -> list[TensorMap]:
    gemma = model_type == "gemma"
    maps = [TensorMap("model.embed_tokens.weight", "embed.tokens.weight"),
            TensorMap("model.norm.weight", "final_norm.weight", plus_one=gemma)]
    if not cfg.tie_embeddings:
        maps.append(TensorMap("lm_head.weight", "head.weight"))
    q, kv, ff = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim
    qkv_rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}  # rows of our fused [Q; K; V]
    for i in range(cfg.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        attn = h + "self_attn."
        maps += [TensorMap(h + "input_layernorm.weight", b + "attn_sublayer.norm.weight", plus_one=gemma),
                 TensorMap(h + "post_attention_layernorm.weight", b + "ffn_sublayer.norm.weight", plus_one=gemma),
                 TensorMap(attn + "o_proj.weight", b + "attn.out.weight"),
                 TensorMap(h + "mlp.down_proj.weight", b + "ffn.down.weight")]
        kinds = ["weight"] + (["bias"] if cfg.uses_bias("qkv") else [])
        if model_type == "phi3":  # fused [Q; K; V] and [gate; up] projections
            maps += [TensorMap(attn + f"qkv_proj.{kind}", b + f"attn.qkv.{kind}") for kind in kinds]
            maps += [TensorMap(h + "mlp.gate_up_proj.weight", b + "ffn.gate.weight", source_rows=(0, ff)),
                     TensorMap(h + "mlp.gate_up_proj.weight", b + "ffn.up.weight", source_rows=(ff, 2 * ff))]
        else:
            maps += [TensorMap(attn + f"{p}_proj.{kind}", b + f"attn.qkv.{kind}", rows=qkv_rows[p])
                     for kind in kinds for p in "qkv"]
            maps += [TensorMap(h + f"mlp.{p}_proj.weight", b + f"ffn.{p}.weight") for p in ("gate", "up")]
        if cfg.uses_bias("out"):
            maps.append(TensorMap(attn + "o_proj.bias", b + "attn.out.bias"))
        if cfg.uses_bias("ffn"):
            maps += [TensorMap(h + f"mlp.{p}_proj.bias", b + f"ffn.{p}.bias") for p in ("gate", "up", "down")]
    return maps


def hf_tensor_map(cfg: ModelConfig, model_type: str, names: Iterable[str] = ()) -> list[TensorMap]:
    """Where each tensor of a Hugging Face checkpoint of ``model_type`` goes in a
    :class:`DecoderOnlyLM` built from ``cfg``. ``names``: the checkpoint's tensor names, to
    tell GPT-2's two spellings apart (``transformer.h.0...`` from save_pretrained of
    GPT2LMHeadModel, ``h.0...`` in OpenAI's released files)."""
    if model_type not in DECODER_TYPES:
        raise ValueError(f"model_type must be one of {DECODER_TYPES}, got {model_type!r}")
    if model_type == "gpt2":
        prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
        return _gpt2_map(cfg, prefix)
    return _llama_map(cfg, model_type)


# llama.cpp's names for the tensors of a LLaMA-family model (its GGUF files), against Hugging
# Face's: the same tensors, renamed, with Q and K in the interleaved RoPE layout.
_GGUF_NAMES = [
    (r"model\.embed_tokens\.", "token_embd."), (r"model\.norm\.", "output_norm."), (r"lm_head\.", "output."),
    (r"model\.layers\.(\d+)\.input_layernorm\.", r"blk.\1.attn_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"blk.\1.ffn_norm."),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.", r"blk.\1.attn_q."),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.", r"blk.\1.attn_k."),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.", r"blk.\1.attn_v."),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"blk.\1.attn_output."),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.", r"blk.\1.ffn_gate."),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.", r"blk.\1.ffn_up."),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"blk.\1.ffn_down."),
]


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face LLaMA tensor (``model.layers.0.self_attn.q_proj.weight``
    -> ``blk.0.attn_q.weight``)."""
    for pattern, replacement in _GGUF_NAMES:
        renamed, n = re.subn("^" + pattern, replacement, hf_name)
        if n:
            return renamed
    raise ValueError(f"{hf_name!r} has no GGUF name in this table")


def gguf_tensor_map(cfg: ModelConfig) -> list[TensorMap]:
    """Where each tensor of a LLaMA GGUF file goes in a :class:`DecoderOnlyLM` built from
    ``cfg``: the LLaMA map of :func:`hf_tensor_map` under llama.cpp's names, with the rows of
    ``attn_q`` (``n_heads`` heads) and ``attn_k`` (``kv_heads`` heads: with grouped-query
    attention, fewer) put back into the half-split RoPE layout."""
    maps = []
    for m in _llama_map(cfg, "llama"):
        source = gguf_tensor_name(m.source)
        heads = cfg.n_heads if ".attn_q." in source else cfg.kv_heads if ".attn_k." in source else 0
        maps.append(m._replace(source=source, rope_heads=heads))
    return maps


# Tensors that checkpoints carry but that are not weights: GPT-2's causal-mask buffers, the RoPE
# frequencies of older LLaMA files, and the output head of a tied model (the token table again).
_NOT_WEIGHTS = re.compile(r"((transformer\.)?h\.\d+\.attn\.(bias|masked_bias)"
                          r"|model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)$")


def check_tensor_names(maps: list[TensorMap], names: Iterable[str], tie_embeddings: bool) -> list[str]:
    """Raise ValueError naming the tensors the map needs but ``names`` lacks, and the tensors
    ``names`` holds that the map does not place (buffers that are not weights excepted).
    Returns the names to skip."""
    names = set(names)
    needed = {m.source for m in maps}
    skipped = sorted(n for n in names - needed
                     if _NOT_WEIGHTS.match(n) or (tie_embeddings and n == "lm_head.weight"))
    missing = sorted(needed - names)
    unexpected = sorted(names - needed - set(skipped))
    if missing or unexpected:
        def show(items):
            return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")
        problems = [f"missing {len(missing)} tensors: {show(missing)}"] if missing else []
        if unexpected:
            problems.append(f"{len(unexpected)} tensors this model has no place for: {show(unexpected)}")
        raise ValueError("the checkpoint does not fit the model: " + "; ".join(problems))
    return skipped


def mapped_tensor(m: TensorMap, tensor: Tensor) -> Tensor:
    """The source tensor as the target wants it: rows taken, reordered to the half-split RoPE
    layout, transposed, 1 added."""
    if m.rope_heads:
        tensor = interleaved_to_half_split(tensor, m.rope_heads)
    if m.source_rows is not None:
        tensor = tensor[m.source_rows[0]:m.source_rows[1]]
    if m.transpose:
        tensor = tensor.t()
    if m.plus_one:
        # in float32, as Gemma computes 1 + w; a bf16 parameter then rounds 1 + w to bf16 (steps of
        # 2^-7 near 1), where Gemma keeps it in float32: a bf16 load's norms differ by up to 2^-8
        tensor = tensor.float() + 1.0
    return tensor


def target_slice(params: dict[str, Tensor], m: TensorMap) -> Tensor:
    dst = params[m.target]
    return dst if m.rows is None else dst[m.rows[0]:m.rows[1]]


def check_shape(m: TensorMap, dst: Tensor, shape: tuple[int, ...]) -> None:
    """Raise ValueError unless a source of ``shape`` fits ``dst`` after :func:`mapped_tensor`."""
    shape = list(shape)
    if m.source_rows is not None:
        shape[0] = m.source_rows[1] - m.source_rows[0] if shape[0] >= m.source_rows[1] else -1
    if m.transpose:
        shape = shape[::-1]
    if tuple(shape) != tuple(dst.shape):
        raise ValueError(f"{m.source} (shape {tuple(shape)}) does not fit {m.target}"
                         f"{'' if m.rows is None else f' rows {m.rows[0]}:{m.rows[1]}'} (shape {tuple(dst.shape)})")


def check_map_covers(model: nn.Module, maps: list[TensorMap]) -> None:
    """Every parameter of ``model`` is filled exactly once, row by row, by the map."""
    params = dict(model.named_parameters())
    rows: dict[str, list[tuple[int, int]]] = {}
    for m in maps:
        if m.target not in params:
            raise ValueError(f"the map fills {m.target}, which the model does not have")
        rows.setdefault(m.target, []).append(m.rows or (0, params[m.target].size(0)))
    for name, param in params.items():
        spans = sorted(rows.get(name, []))
        ends = [0] + [end for _, end in spans]
        if not spans or [start for start, _ in spans] != ends[:-1] or ends[-1] != param.size(0):
            raise ValueError(f"the map does not fill {name} (rows {spans} of {param.size(0)})")


@torch.no_grad()
def load_hf_state_dict(model: DecoderOnlyLM, hf_state: dict[str, Tensor], model_type: str) -> DecoderOnlyLM:
    """Copy a Hugging Face state dict of ``model_type`` into ``model`` (built from the same config)."""
    maps = hf_tensor_map(model.cfg, model_type, hf_state)
    check_tensor_names(maps, hf_state, model.cfg.tie_embeddings)
    check_map_covers(model, maps)
    params = dict(model.named_parameters())
    for m in maps:
        dst = target_slice(params, m)
        check_shape(m, dst, tuple(hf_state[m.source].shape))
        dst.copy_(mapped_tensor(m, hf_state[m.source]))
    return model


def from_hf_model(hf_model: nn.Module) -> DecoderOnlyLM:
    """A :class:`DecoderOnlyLM` with the weights of a Hugging Face causal LM in memory
    (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, GemmaForCausalLM,
    Phi3ForCausalLM). Its config is read as for load_pretrained
    (:func:`tutorial_lib.hf_config.decoder_config`)."""
    hf = hf_model.config.to_dict()
    model = DecoderOnlyLM(decoder_config(hf))
    return load_hf_state_dict(model, hf_model.state_dict(), hf["model_type"]).eval()


def gpt2_from_hf(hf_model: nn.Module) -> DecoderOnlyLM:
    """A :class:`DecoderOnlyLM` with the weights of a Hugging Face ``GPT2LMHeadModel``."""
    return from_hf_model(hf_model)


def llama_from_hf(hf_model: nn.Module) -> DecoderOnlyLM:
    """A :class:`DecoderOnlyLM` with the weights of a Hugging Face ``LlamaForCausalLM`` (or
    another member of the LLaMA family)."""
    return from_hf_model(hf_model)
