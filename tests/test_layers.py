"""Norms, feed-forward networks, residual orders and the encoder layer against PyTorch and BERT."""

import math

import pytest
import torch
from torch import nn

from tutorial_lib.config import ModelConfig
from tutorial_lib.convert import copy_from_bert_layer, copy_from_torch_encoder_layer
from tutorial_lib.layers import (
    FeedForward,
    Residual,
    RMSNorm,
    TransformerBlock,
    init_weights,
    residual_branches,
)
from tutorial_lib.masks import key_padding_to_torch, padding_mask
from tutorial_lib.transformer import Encoder, EncoderDecoder, EncoderLayer

ATOL = 1e-5


def test_rmsnorm_equals_torch_rmsnorm_and_does_not_centre():
    x = torch.randn(3, 5, 16) * 3 + 2
    ours, theirs = RMSNorm(16, eps=1e-6), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16))
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x), atol=ATOL, rtol=0)
    y = RMSNorm(16)(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3, 5), atol=1e-4, rtol=0)
    assert y.mean(-1).abs().max() > 0.1, "RMSNorm must not subtract the mean"
    assert [n for n, _ in RMSNorm(8).named_parameters()] == ["weight"]


def test_rmsnorm_float32_path_gives_the_bits_of_norm_then_scale():
    # float32 inputs take one call with the scale inside (the decoding hot path); it must give
    # exactly what normalising first and multiplying by the scale afterwards gives
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16) * 2)
    x = torch.randn(4, 7, 16) * 3 + 1
    two_steps = norm.weight * torch.nn.functional.rms_norm(x, (16,), eps=1e-6)
    assert torch.equal(norm(x), two_steps), "the one-call float32 path changed the numbers"
    assert norm(x.double()).dtype == torch.float64, "a float64 input must come back float64"


def test_rmsnorm_epsilon_is_inside_the_square_root():
    x = torch.full((1, 4), 1e-3)
    eps = 1e-2
    expected = 1e-3 / math.sqrt(1e-6 + eps)
    torch.testing.assert_close(RMSNorm(4, eps=eps)(x), torch.full((1, 4), expected))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_plain_ffn_is_down_act_up(activation):
    ffn = FeedForward(8, 32, activation)
    x = torch.randn(2, 3, 8)
    act = {"relu": torch.relu, "gelu": nn.functional.gelu,
           "gelu_tanh": lambda t: nn.functional.gelu(t, approximate="tanh")}[activation]
    torch.testing.assert_close(ffn(x), ffn.down(act(ffn.up(x))))
    assert ffn.gate is None and ffn.up.out_features == 32


@pytest.mark.parametrize("activation,act", [("swiglu", nn.functional.silu), ("geglu", nn.functional.gelu)])
def test_gated_ffn_multiplies_activated_gate_by_up(activation, act):
    ffn = FeedForward(8, 24, activation, bias=False)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ffn(x), ffn.down(act(ffn.gate(x)) * ffn.up(x)))
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 8 * 24


def test_ffn_inner_width_defaults_to_four_d_and_rejects_unknown_activation():
    assert FeedForward(10).up.out_features == 40
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(8, activation="tanh")


def test_residual_orders():
    norm = nn.LayerNorm(4)
    x = torch.randn(2, 4)
    f = lambda t: 2 * t + 1
    torch.testing.assert_close(Residual(norm, "pre")(x, f), x + f(norm(x)))
    torch.testing.assert_close(Residual(norm, "post")(x, f), norm(x + f(x)))
    with pytest.raises(ValueError, match="'pre' or 'post'"):
        Residual(norm, "middle")


def encoder_cfg(order, ffn, d=32, h=4, eps=1e-5):
    return ModelConfig(family="encoder", d_model=d, n_heads=h, d_ff=64, norm_order=order, ffn=ffn, norm_eps=eps)


@pytest.mark.parametrize("order", ["post", "pre"])
@pytest.mark.parametrize("ffn", ["relu", "gelu"])
def test_encoder_layer_equals_torch_encoder_layer_with_padding(order, ffn):
    cfg = encoder_cfg(order, ffn)
    ours = EncoderLayer(cfg).eval()
    theirs = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation=ffn, batch_first=True,
                                        norm_first=order == "pre").eval()
    copy_from_torch_encoder_layer(ours, theirs)
    x = torch.randn(3, 7, 32)
    keep = padding_mask(torch.tensor([7, 5, 2]), 7)
    expected = theirs(x, src_key_padding_mask=key_padding_to_torch(keep))
    got = ours(x, keep).x
    # PyTorch's fast path may leave padded query rows as zeros; compare the real positions.
    real = keep[:, 0, 0, :]
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


def test_post_ln_gelu_layer_equals_bert_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    bert_cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       hidden_act="gelu", layer_norm_eps=1e-12)
    bert_cfg._attn_implementation = "eager"
    bert = BertLayer(bert_cfg).eval()
    ours = EncoderLayer(encoder_cfg("post", "gelu", eps=1e-12)).eval()
    copy_from_bert_layer(ours, bert)
    x = torch.randn(2, 6, 32)
    keep = padding_mask(torch.tensor([6, 4]), 6)
    additive = torch.zeros(2, 1, 1, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    out = bert(x, attention_mask=additive)
    expected = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(ours(x, keep).x, expected, atol=ATOL, rtol=0)


def test_pre_ln_block_has_exactly_12576_parameters():
    cfg = ModelConfig(family="encoder", d_model=32, n_heads=4, d_ff=128, norm="layernorm", norm_order="pre",
                      qkv_bias=False, out_bias=False, ffn_bias=True, norm_bias=True)
    block = TransformerBlock(cfg)
    # attention 4*32*32 = 4096; FFN 32*128 + 128 + 128*32 + 32 = 8352; two LayerNorms 2*(32+32) = 128
    assert sum(p.numel() for p in block.parameters()) == 12_576


def test_encoder_stack_has_final_norm_only_for_pre_ln_and_masks_padding():
    pre = Encoder(encoder_cfg("pre", "gelu"))
    post = Encoder(encoder_cfg("post", "gelu"))
    assert isinstance(pre.final_norm, nn.LayerNorm) and isinstance(post.final_norm, nn.Identity)
    pre.eval()
    x = torch.randn(2, 5, 32)
    keep = padding_mask(torch.tensor([5, 3]), 5)
    out = pre(x, keep, need_weights=True)
    assert out.weights.shape == (2, 2, 4, 5, 5)
    assert (out.weights[:, 1, :, :, 3:] == 0).all(), "padded keys must get zero weight in every layer"
    x2 = x.clone()
    x2[1, 3:] = torch.randn(2, 32)  # change the padding
    torch.testing.assert_close(pre(x2, keep).x[1, :3], out.x[1, :3], atol=ATOL, rtol=0)


def test_initialisation_options():
    base = ModelConfig(family="encoder", d_model=32, n_heads=4, n_layers=3)
    model = Encoder(base)
    init_weights(model, base)
    w = model.layers[0].attn.qkv.weight
    assert abs(w.std().item() - 0.02) < 0.003 and model.layers[0].attn.qkv.bias.abs().max() == 0

    zero = ModelConfig(family="encoder", d_model=32, n_heads=4, n_layers=3, zero_init_out=True)
    model = Encoder(zero)
    init_weights(model, zero)
    for layer in model.layers:
        assert layer.attn.out.weight.abs().max() == 0 and layer.ffn.down.weight.abs().max() == 0
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(model.layers[0](x).x, x)  # zero-initialised branches: the identity

    torch.manual_seed(1)
    m1 = Encoder(base)
    init_weights(m1, base)
    for option in ({"scale_residual_init": True}, {"qk_gain": 0.5}):
        cfg = ModelConfig(family="encoder", d_model=32, n_heads=4, n_layers=3, **option)
        torch.manual_seed(1)
        m2 = Encoder(cfg)
        init_weights(m2, cfg)
        if "qk_gain" in option:
            qk = slice(0, 64)  # W_Q and W_K rows
            torch.testing.assert_close(m2.layers[0].attn.qkv.weight[qk], 0.5 * m1.layers[0].attn.qkv.weight[qk])
            torch.testing.assert_close(m2.layers[0].attn.qkv.weight[64:], m1.layers[0].attn.qkv.weight[64:])
        else:
            torch.testing.assert_close(m2.layers[1].ffn.down.weight, m1.layers[1].ffn.down.weight / math.sqrt(6))


@pytest.mark.parametrize("family", ["encoder", "decoder", "encoder-decoder"])
def test_residual_scaling_counts_every_residual_branch(family):
    """A decoder layer of an encoder-decoder has three residual branches (self, cross, FFN):
    scale_residual_init divides by sqrt of the number of Residual modules actually built."""
    from tutorial_lib.gpt import DecoderOnlyLM

    extra = {"n_decoder_layers": 3, "vocab_size": 11} if family == "encoder-decoder" else {"vocab_size": 11}
    base = ModelConfig(family=family, d_model=16, n_heads=2, n_layers=2, **extra)
    build = {"encoder": Encoder, "decoder": DecoderOnlyLM, "encoder-decoder": EncoderDecoder}[family]
    torch.manual_seed(3)
    plain = build(base)
    if family == "encoder":
        init_weights(plain, base)
    built = sum(isinstance(m, Residual) for m in plain.modules())
    assert residual_branches(base) == built == {"encoder": 4, "decoder": 4, "encoder-decoder": 4 + 9}[family]

    scaled_cfg = ModelConfig(family=family, d_model=16, n_heads=2, n_layers=2, scale_residual_init=True, **extra)
    torch.manual_seed(3)
    scaled = build(scaled_cfg)
    if family == "encoder":
        init_weights(scaled, scaled_cfg)
    plain_outputs = [m.weight for n, m in plain.named_modules() if n.endswith((".out", ".down"))]
    scaled_outputs = [m.weight for n, m in scaled.named_modules() if n.endswith((".out", ".down"))]
    assert len(plain_outputs) == built
    for a, b in zip(plain_outputs, scaled_outputs):
        torch.testing.assert_close(b, a / math.sqrt(built))
