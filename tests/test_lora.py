"""LoRA (tutorial_lib.lora): the model is unchanged at initialisation, merged and unmerged
adapters compute the same thing, one layer equals peft's LoRA (outputs and gradients of A, B
and the input), a LLaMA-flavour model with split Q/K/V adapters equals peft on transformers'
LlamaForCausalLM (separate q/k/v projections), the trainable count is r (d_in + d_out) per
matrix on a tiny model and on the bundled SmolLM2-135M (2,442,240 at r = 8), only the
adapters train, a quantized base (a stand-in, and BlockQuantLinear on the bundled model's
own Q4_1 bytes) takes adapters, cross-attention reads the adapted weight, and bad arguments
are refused. The real model is loaded once for the module."""

import copy
import math

import pytest
import torch
from torch import nn

from tutorial_lib import pretrained
from tutorial_lib.config import ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.lora import (
    DEFAULT_TARGETS,
    LoRALinear,
    add_lora,
    count_lora_parameters,
    lora_layers,
    lora_parameters,
    merge_lora,
)
from tutorial_lib.quant_linear import BlockQuantLinear, gguf_blocks, quantize_linears

TINY = ModelConfig(family="decoder", vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                   max_len=32, norm="rmsnorm", ffn="swiglu", positions="rope", bias=False, tie_embeddings=False)
R, ALPHA = 4, 8.0


def tiny_model(cfg: ModelConfig = TINY, seed: int = 0) -> DecoderOnlyLM:
    torch.manual_seed(seed)
    return DecoderOnlyLM(cfg).eval()


def randomise_b(model: nn.Module, std: float = 0.05, seed: int = 1) -> None:
    """B is zero after add_lora; a nonzero B makes the update (and the comparisons) visible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * std)


def ids_for(cfg: ModelConfig, B: int = 2, T: int = 11, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- initialisation, counts, freezing -------------------------------------------------------------


def test_logits_are_unchanged_at_initialisation_exactly():
    model = tiny_model()
    ids = ids_for(TINY)
    with torch.no_grad():
        before = model(ids).logits
        add_lora(model, R, ALPHA)
        after = model(ids).logits
    assert torch.equal(before, after)  # B = 0: the update is exactly zero
    for layer in lora_layers(model).values():
        assert torch.count_nonzero(layer.lora_B) == 0
        bound = 1 / math.sqrt(layer.in_features)  # nn.Linear's and peft's init of A
        assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > 0.9 * bound


def test_trainable_count_is_r_times_in_plus_out_per_matrix_on_a_tiny_llama():
    model = tiny_model()
    n = add_lora(model, R, ALPHA)
    d, q, kv, ff = 64, 64, 32, 128  # 4 heads of 16, 2 key/value heads
    per_layer = R * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + ff) + (ff + d))  # q, k, v, out, gate, up, down
    assert per_layer == 4 * 1024
    assert n == 2 * per_layer == 8192 == count_lora_parameters(model)
    assert set(lora_layers(model)) == {f"blocks.{i}.{p}" for i in range(2)
                                       for p in ("attn.qkv", "attn.out", "ffn.up", "ffn.gate", "ffn.down")}
    assert lora_layers(model)["blocks.0.attn.qkv"].splits == (q, kv, kv)
    # one adapter on the fused [Q; K; V] matrix instead: r (d + q + 2 kv) for it
    fused = tiny_model()
    assert add_lora(fused, R, ALPHA, split_qkv=False) == 2 * R * ((d + q + 2 * kv) + (q + d) + 2 * (d + ff) + (ff + d))


@pytest.mark.parametrize("flavour", ["gpt", "moe"])
def test_gpt_flavour_and_mixture_of_experts(flavour):
    """GELU without a gate, biases and a tied head; or experts (each one's matrices adapted,
    not the router): unchanged at initialisation, merged = unmerged with a nonzero B."""
    if flavour == "gpt":
        cfg = ModelConfig(family="decoder", vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_len=16,
                          norm="layernorm", ffn="gelu", positions="learned", bias=True, tie_embeddings=True)
    else:
        cfg = ModelConfig(family="decoder", vocab_size=50, d_model=32, n_layers=2, n_heads=2, d_ff=48, max_len=16,
                          n_experts=4, experts_per_token=2, ffn="swiglu", norm="rmsnorm", positions="rope")
    model = tiny_model(cfg)
    ids = ids_for(cfg)
    with torch.no_grad():
        before = model(ids).logits
    n = add_lora(model, 2, 4.0)
    names = set(lora_layers(model))
    if flavour == "gpt":  # per layer: q, k, v, out (32 -> 32 each), up (32 -> 128), down (128 -> 32)
        assert n == 2 * 2 * (4 * (32 + 32) + 2 * (32 + 128)) == 2304
        assert "blocks.0.ffn.up" in names and "head" not in names
    else:  # per layer: q, k, v, out, and 4 experts of gate, up (32 -> 48), down (48 -> 32)
        assert n == 2 * 2 * (4 * (32 + 32) + 4 * 3 * (32 + 48)) == 4864
        assert "blocks.1.ffn.experts.3.gate" in names and not any("router" in name for name in names)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
        randomise_b(model)
        unmerged = model(ids).logits
        merge_lora(model)
        assert (unmerged - before).abs().max() > 1e-3
        torch.testing.assert_close(model(ids).logits, unmerged, atol=2e-5, rtol=1e-5)


def test_only_the_adapters_require_grad_and_get_gradients():
    model = tiny_model()
    add_lora(model, R, ALPHA)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model))
    assert trainable and all(name.endswith(("lora_A", "lora_B")) for name in trainable)
    assert not model.embed.tokens.weight.requires_grad and not model.head.weight.requires_grad
    randomise_b(model)
    ids = ids_for(TINY)
    model(ids, ids).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    assert all(p.grad.abs().sum() > 0 for p in lora_parameters(model).values())


def test_dropout_applies_to_the_adapter_input_in_training_only():
    base = nn.Linear(16, 8)
    layer = LoRALinear(base, 2, 4.0, dropout=0.5)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 16)
    layer.eval()
    assert torch.allclose(layer(x), base(x) + 2.0 * (x @ layer.lora_A.T @ layer.lora_B.T), atol=1e-6)
    layer.train()
    torch.manual_seed(0)
    y = layer(x)
    assert not torch.allclose(y, layer.eval()(x))


# ---- merging -------------------------------------------------------------------------------------------


def test_merged_and_unmerged_logits_agree_after_training():
    model = tiny_model()
    ids = ids_for(TINY, B=4, T=16)
    with torch.no_grad():
        original = model(ids).logits
    add_lora(model, R, ALPHA, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        model(ids, ids).loss.backward()
        opt.step()
    with torch.no_grad():
        unmerged = model(ids).logits
        names = merge_lora(model)
        merged = model(ids).logits
    assert (unmerged - original).abs().max() > 1e-2  # the steps changed the model
    torch.testing.assert_close(merged, unmerged, atol=2e-5, rtol=1e-5)  # float32 rounding
    assert len(names) == 10 and not lora_layers(model)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in names)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in tiny_model().parameters())


def test_merging_a_tied_layer_unties_it_instead_of_changing_the_embedding():
    cfg = ModelConfig(family="decoder", vocab_size=40, d_model=32, n_layers=1, n_heads=2, max_len=16,
                      tie_embeddings=True)
    model = tiny_model(cfg)
    table = model.embed.tokens.weight.detach().clone()
    add_lora(model, 2, 4.0, targets="head")
    randomise_b(model)
    ids = ids_for(cfg)
    with torch.no_grad():
        unmerged = model(ids).logits
        merge_lora(model)
        merged = model(ids).logits
    assert torch.equal(model.embed.tokens.weight, table)
    assert model.head.weight is not model.embed.tokens.weight
    torch.testing.assert_close(merged, unmerged, atol=2e-5, rtol=1e-5)


def test_cross_attention_reads_the_adapted_weight():
    """The encoder-decoder's cross-attention splits qkv.weight into Q and K/V rows instead of
    calling the layer: LoRALinear.weight is W + (alpha / r) B A, so the merged model agrees."""
    from tutorial_lib.sampling import greedy_decode
    from tutorial_lib.transformer import EncoderDecoder

    cfg = ModelConfig(family="encoder-decoder", vocab_size=30, src_vocab_size=30, d_model=32, n_layers=1,
                      n_heads=2, d_ff=64, max_len=16, dropout=0.0)
    torch.manual_seed(0)
    model = EncoderDecoder(cfg).eval()
    add_lora(model, 2, 4.0)
    assert "decoder.layers.0.cross_attn.qkv" in lora_layers(model)
    randomise_b(model, std=0.3)
    src, tgt = ids_for(cfg, T=7), ids_for(cfg, T=5, seed=4)
    with torch.no_grad():
        adapted = model(src, tgt).logits
        decoded = greedy_decode(model, src, max_len=6, bos_id=1, eos_id=2, pad_id=0).ids
        merged = copy.deepcopy(model)
        merge_lora(merged)
        torch.testing.assert_close(merged(src, tgt).logits, adapted, atol=2e-5, rtol=1e-5)
        assert torch.equal(greedy_decode(merged, src, max_len=6, bos_id=1, eos_id=2, pad_id=0).ids, decoded)


# ---- against peft ------------------------------------------------------------------------------------------


class OneLayer(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


def test_one_layer_equals_peft_outputs_and_gradients():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Linear(48, 40, bias=True)
    theirs = peft.get_peft_model(OneLayer(copy.deepcopy(base)),
                                 peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["proj"]))
    ours = LoRALinear(copy.deepcopy(base), R, ALPHA)
    peft_layer = theirs.base_model.model.proj
    with torch.no_grad():
        ours.lora_B.normal_(std=0.1)
        peft_layer.lora_A["default"].weight.copy_(ours.lora_A)
        peft_layer.lora_B["default"].weight.copy_(ours.lora_B)
    x = torch.randn(3, 5, 48)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_y = torch.randn(3, 5, 40)
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    (y_ours * grad_y).sum().backward()
    (y_theirs * grad_y).sum().backward()
    torch.testing.assert_close(y_ours, y_theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.lora_A.grad, peft_layer.lora_A["default"].weight.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.lora_B.grad, peft_layer.lora_B["default"].weight.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=1e-6, rtol=0)
    assert ours.lora_B.grad.abs().max() > 1e-2 and ours.lora_A.grad.abs().max() > 1e-3  # not trivially zero
    assert peft_layer.scaling["default"] == ours.scaling == ALPHA / R


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_split_qkv_adapters_equal_peft_on_transformers_llama():
    """Our fused [Q; K; V] layer with one adapter per part = peft on LlamaForCausalLM's three
    projections: the same logits, gradients and trainable count, with A and B copied over."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tutorial_lib.convert import llama_from_hf

    hf_cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    ours = llama_from_hf(hf)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                     target_modules=targets))
    n = add_lora(ours, R, ALPHA)
    assert n == sum(p.numel() for p in theirs.parameters() if p.requires_grad) == 8192

    def peft_pair(i, name):
        part = dict(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                    gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")[name]
        layer = theirs.base_model.model.model.layers[i].get_submodule(part)
        return layer.lora_A["default"].weight, layer.lora_B["default"].weight

    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i, block in enumerate(ours.blocks):
            for name, ours_layer in (("o", block.attn.out), ("gate", block.ffn.gate), ("up", block.ffn.up),
                                     ("down", block.ffn.down)):
                A, B = peft_pair(i, name)
                B.copy_(torch.randn(B.shape, generator=g) * 0.05)
                ours_layer.lora_A.copy_(A)
                ours_layer.lora_B.copy_(B)
            parts = [peft_pair(i, p) for p in "qkv"]
            for _, B in parts:
                B.copy_(torch.randn(B.shape, generator=g) * 0.05)
            block.attn.qkv.lora_A.copy_(torch.cat([A for A, _ in parts]))  # (3 r, d): A_q, A_k, A_v
            block.attn.qkv.lora_B.copy_(torch.cat([B for _, B in parts]))  # (q + 2 kv, r): B_q, B_k, B_v
    ids = ids_for(TINY, B=2, T=13)
    ours_out = ours(ids, ids)
    theirs_out = theirs(input_ids=ids)
    torch.testing.assert_close(ours_out.logits, theirs_out.logits, atol=1e-5, rtol=0)
    ours_out.loss.backward()
    torch.nn.functional.cross_entropy(theirs_out.logits.flatten(0, 1), ids.flatten()).backward()
    qkv = ours.blocks[1].attn.qkv
    A_q, B_q = peft_pair(1, "q")
    A_v, B_v = peft_pair(1, "v")
    torch.testing.assert_close(qkv.lora_A.grad[:R], A_q.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(qkv.lora_A.grad[2 * R:], A_v.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(qkv.lora_B.grad[:64], B_q.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(qkv.lora_B.grad[96:], B_v.grad, atol=1e-6, rtol=1e-4)
    A_down, B_down = peft_pair(0, "down")
    torch.testing.assert_close(ours.blocks[0].ffn.down.lora_A.grad, A_down.grad, atol=1e-6, rtol=1e-4)
    assert A_q.grad.abs().max() > 1e-4


# ---- a quantized base ------------------------------------------------------------------------------------------


class Int8Rows(nn.Module):
    """A stand-in for a quantized layer: int8 codes and one scale per row, as buffers (nothing
    to train), dequantized in the forward pass; no nn.Linear, no weight attribute."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        self.register_buffer("codes", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized_weight(self):
        return self.codes.float() * self.scale

    def forward(self, x):
        return x @ self.dequantized_weight().T


def quantize_tiny(model: nn.Module, make) -> nn.Module:
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "head":
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, make(module))
    return model


@pytest.mark.parametrize("kind", ["stand-in", "BlockQuantLinear Q4_1"])
def test_lora_on_a_quantized_base(kind):
    if kind == "stand-in":
        make = Int8Rows
    else:
        make = lambda linear: BlockQuantLinear.from_float(linear.weight, "Q4_1", linear.bias)
    model = quantize_tiny(tiny_model(), make)
    assert not any(isinstance(m, nn.Linear) for n, m in model.named_modules() if n != "head")
    ids = ids_for(TINY)
    with torch.no_grad():
        before = model(ids).logits
    stored = {name: b.clone() for name, b in model.named_buffers()}
    assert add_lora(model, R, ALPHA) == 8192  # the same count as on the float model
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(lora_parameters(model))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(ids, ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # the gradient reached the first layer's adapters through every frozen quantized layer after it
    assert model.blocks[0].attn.qkv.lora_A.grad.abs().sum() > 0
    assert all(torch.equal(b, stored[name]) for name, b in model.named_buffers() if name in stored)
    with torch.no_grad():
        unmerged = model(ids).logits
        merge_lora(model)
        assert type(model.blocks[0].ffn.down) is nn.Linear  # the dequantized weight plus the update
        torch.testing.assert_close(model(ids).logits, unmerged, atol=2e-5, rtol=1e-5)


# ---- the bundled SmolLM2-135M-Instruct --------------------------------------------------------------------------

def test_bundled_model_count_freezing_and_unchanged_logits(smollm2):
    model = copy.deepcopy(smollm2.model)
    ids = torch.tensor([smollm2.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        before = model(ids).logits
    n = add_lora(model, 8, 16)
    d, q, kv, ff = 576, 9 * 64, 3 * 64, 1536
    per_layer = 8 * ((d + q) + 2 * (d + kv) + (q + d) + 3 * (d + ff))  # q, k, v, o, gate, up, down
    assert per_layer == 81_408 and n == 30 * per_layer == 2_442_240
    assert len(lora_layers(model)) == 30 * 5 and len(lora_parameters(model)) == 300
    total = sum(p.numel() for p in model.parameters())  # the tied table once
    assert total == 134_515_008 + n and n / total < 0.02
    assert {name for name, p in model.named_parameters() if p.requires_grad} == set(lora_parameters(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_bundled_model_on_its_own_q4_1_bytes(smollm2):
    """QLoRA's setting: the frozen base is the file's Q4_1 blocks (BlockQuantLinear), the
    adapters float32; the gradient reaches the adapters of layer 0."""

    model = copy.deepcopy(smollm2.model)
    blocks = gguf_blocks(model, pretrained.bundled_gguf())
    quantize_linears(model, lambda name, linear: BlockQuantLinear(*blocks[name]), skip=("head",))
    ids = torch.tensor([smollm2.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        reference = smollm2.model(ids).logits  # float32 weights dequantized from the same bytes
    assert add_lora(model, 8, 16, targets=DEFAULT_TARGETS[:2] + ("*.ffn.*",)) == 2_442_240  # = the default
    assert isinstance(model.blocks[0].ffn.up.base, BlockQuantLinear)
    randomise_b(model, std=0.01)
    out = model(ids, ids)
    out.loss.backward()
    assert model.blocks[0].attn.qkv.lora_A.grad.abs().sum() > 0
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.zero_()
        torch.testing.assert_close(model(ids).logits, reference, atol=1e-4, rtol=0)


# ---- bad arguments ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r, alpha, message", [(0, 8, "r must be a positive int.*got 0"),
                                               (4.0, 8, "r must be a positive int.*4.0 of type float"),
                                               (True, 8, "r must be.*True"),
                                               (4, 0, r"alpha must lie in \(0, inf\), got 0"),
                                               (4, -1.5, r"alpha must lie in \(0, inf\), got -1.5")])
def test_bad_rank_or_alpha(r, alpha, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        add_lora(model, r, alpha)
    assert not lora_layers(model)  # nothing changed
    with pytest.raises(ValueError, match=message):
        LoRALinear(nn.Linear(4, 4), r, alpha)


def test_bad_targets_and_a_second_add():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"'\*\.q_proj' matches no linear layer of DecoderOnlyLM.*blocks\.0\.attn"):
        add_lora(model, R, ALPHA, targets=["*.ffn.up", "*.q_proj"])
    assert not lora_layers(model)  # checked before any change
    with pytest.raises(ValueError, match="matches no linear layer"):
        add_lora(model, R, ALPHA, targets="*.attn")  # the attention module itself is not a linear layer
    for bad in ([], [3], ""):
        with pytest.raises(ValueError, match="targets must be an fnmatch pattern"):
            add_lora(model, R, ALPHA, targets=bad)
    with pytest.raises(ValueError, match=r"dropout must lie in \[0, 1\)"):
        add_lora(model, R, ALPHA, dropout=1.0)
    add_lora(model, R, ALPHA)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(model, R, ALPHA)
    merge_lora(model)
    with pytest.raises(ValueError, match="no LoRA adapters to merge"):
        merge_lora(model)
    with pytest.raises(ValueError, match="LoRALinear wraps a linear layer.*got ReLU"):
        LoRALinear(nn.ReLU(), R, ALPHA)
    with pytest.raises(ValueError, match="splits must be positive ints that add up to out_features=8"):
        LoRALinear(nn.Linear(4, 8), R, ALPHA, splits=(4, 3))
