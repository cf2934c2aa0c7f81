"""Copying weights between tutorial_lib models and other implementations: PyTorch's
``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` / ``nn.Transformer``, and
Hugging Face's BERT layer, GPT-2 and LLaMA. Tests use these to check our models against
independent code; with internet access the same functions load real GPT-2 weights::

    from transformers import GPT2LMHeadModel
    model = gpt2_from_hf(GPT2LMHeadModel.from_pretrained("gpt2"))
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .config import from_hf_config
from .gpt import DecoderOnlyLM
from .layers import FeedForward, TransformerBlock
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


def gpt2_state_dict(hf_state: dict[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """Rename (and transpose) a ``GPT2LMHeadModel`` state dict into ours.

    GPT-2 stores its projections as ``Conv1D`` with weights (in, out): ours are ``nn.Linear``
    (out, in), hence the transposes. ``c_attn`` is already a fused [Q; K; V] projection.
    """
    def get(name):
        key = name if name in hf_state else f"transformer.{name}"
        if key not in hf_state:
            raise ValueError(f"GPT-2 state dict has no {name!r}")
        return hf_state[key]

    out = {"embed.tokens.weight": get("wte.weight"), "embed.positions.embedding.weight": get("wpe.weight"),
           "final_norm.weight": get("ln_f.weight"), "final_norm.bias": get("ln_f.bias")}
    for i in range(n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        out |= {
            b + "attn_sublayer.norm.weight": get(h + "ln_1.weight"),
            b + "attn_sublayer.norm.bias": get(h + "ln_1.bias"),
            b + "attn.qkv.weight": get(h + "attn.c_attn.weight").t(), b + "attn.qkv.bias": get(h + "attn.c_attn.bias"),
            b + "attn.out.weight": get(h + "attn.c_proj.weight").t(), b + "attn.out.bias": get(h + "attn.c_proj.bias"),
            b + "ffn_sublayer.norm.weight": get(h + "ln_2.weight"), b + "ffn_sublayer.norm.bias": get(h + "ln_2.bias"),
            b + "ffn.up.weight": get(h + "mlp.c_fc.weight").t(), b + "ffn.up.bias": get(h + "mlp.c_fc.bias"),
            b + "ffn.down.weight": get(h + "mlp.c_proj.weight").t(), b + "ffn.down.bias": get(h + "mlp.c_proj.bias"),
        }
    return out


def llama_state_dict(hf_state: dict[str, Tensor], n_layers: int, tie_embeddings: bool) -> dict[str, Tensor]:
    """Rename a ``LlamaForCausalLM`` state dict into ours (q, k, v concatenated into ``qkv``).

    Both use the same half-split RoPE pairing (``rotate_half``), so no permutation of the
    query and key rows is needed.
    """
    def get(name):
        if name not in hf_state:
            raise ValueError(f"LLaMA state dict has no {name!r}")
        return hf_state[name]

    out = {"embed.tokens.weight": get("model.embed_tokens.weight"), "final_norm.weight": get("model.norm.weight")}
    if not tie_embeddings:
        out["head.weight"] = get("lm_head.weight")
    for i in range(n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        attn = h + "self_attn."
        out[b + "attn.qkv.weight"] = torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"])
        if attn + "q_proj.bias" in hf_state:
            out[b + "attn.qkv.bias"] = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        out[b + "attn.out.weight"] = get(attn + "o_proj.weight")
        if attn + "o_proj.bias" in hf_state:
            out[b + "attn.out.bias"] = get(attn + "o_proj.bias")
        for ours_name, theirs_name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[b + f"ffn.{ours_name}.weight"] = get(h + f"mlp.{theirs_name}.weight")
            if h + f"mlp.{theirs_name}.bias" in hf_state:
                out[b + f"ffn.{ours_name}.bias"] = get(h + f"mlp.{theirs_name}.bias")
        out[b + "attn_sublayer.norm.weight"] = get(h + "input_layernorm.weight")
        out[b + "ffn_sublayer.norm.weight"] = get(h + "post_attention_layernorm.weight")
    return out


def _load(model: DecoderOnlyLM, state: dict[str, Tensor]) -> DecoderOnlyLM:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "head.weight" and model.cfg.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model


def gpt2_from_hf(hf_model: nn.Module) -> DecoderOnlyLM:
    """A :class:`DecoderOnlyLM` with the weights of a Hugging Face ``GPT2LMHeadModel``."""
    cfg = from_hf_config(hf_model.config.to_dict())
    return _load(DecoderOnlyLM(cfg), gpt2_state_dict(hf_model.state_dict(), cfg.n_layers)).eval()


def llama_from_hf(hf_model: nn.Module) -> DecoderOnlyLM:
    """A :class:`DecoderOnlyLM` with the weights of a Hugging Face ``LlamaForCausalLM``."""
    cfg = from_hf_config(hf_model.config.to_dict())
    state = llama_state_dict(hf_model.state_dict(), cfg.n_layers, cfg.tie_embeddings)
    return _load(DecoderOnlyLM(cfg), state).eval()
