"""Linear layers with quantized weights: PyTorch's int4 and int8 CPU kernels compute the Q4_1
(or per-channel int8) weights we give them, up to bfloat16 roundings; the block layer's
products and input gradients are those of the dequantized weight, bit for bit, and autograd
keeps no float copy of it; the file's blocks land in the model's rows as the loader's floats
do; the bundled model on the 4-bit kernel predicts what the float32 one does."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorial_lib import gguf
from tutorial_lib.pretrained import bundled_gguf, load_pretrained
from tutorial_lib.quant import quantize, quantize_symmetric
from tutorial_lib.quant_linear import (
    BlockQuantLinear,
    Int4Linear,
    Int8Linear,
    gguf_blocks,
    int4_from_gguf,
    quantize_linears,
)


@pytest.fixture(scope="module")
def bundled():
    path = bundled_gguf()
    model, tokenizer, _ = load_pretrained(path)
    return path, model, tokenizer


def _bf16(t):
    return t.to(torch.bfloat16).float()


def test_int4_kernel_computes_the_q4_1_weights():
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05 + 0.02  # one-signed offset: the minimum m matters
    blocks = quantize(w, "Q4_1")
    layer = Int4Linear.from_q4_1(blocks)
    x = torch.randn(5, 128)
    y = layer(x)
    # what the kernel should compute: bf16 x times (q - 8) * bf16(d) + bf16(m + 8d), rounded to bf16
    b = blocks.view(96, 4, 20)
    d = b[..., :2].contiguous().view(torch.float16).float()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    q = torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], -1).float()  # (96, 4, 32)
    w_kernel = ((q - 8) * _bf16(d) + _bf16(m + 8 * d)).reshape(96, 128)
    expected = _bf16(x) @ w_kernel.t()
    assert (y - expected).abs().max() <= 2 ** -7 * expected.abs().max()
    # against the exact Q4_1 weights the gap is bfloat16's, far below one quantization step
    exact = x @ gguf.dequantize(blocks, "Q4_1").t()
    assert (y - exact).abs().max() < 0.02 * exact.abs().max()
    # a zero of m instead of m + 8d, or the nibbles in the wrong order, would miss by far more
    wrong = x @ ((q - 8) * d + m).reshape(96, 128).t()
    assert (wrong - exact).abs().max() > 0.2 * exact.abs().max()
    assert y.shape == (5, 96) and layer(x[None]).shape == (1, 5, 96)
    assert layer.weight_bytes() == 96 * 64 + 4 * 96 * 2 * 2  # nibbles + bf16 scale and zero per group


def test_int8_kernel_computes_the_per_channel_weights():
    torch.manual_seed(1)
    w, bias = torch.randn(40, 64), torch.randn(40)
    layer = Int8Linear.from_float(w, bias)
    x = torch.randn(3, 64)
    q = quantize_symmetric(w, 8, "channel")
    expected = _bf16(x) @ (q.q.float() * _bf16(q.scale)[:, None]).t() + bias
    assert (layer(x) - expected).abs().max() <= 2 ** -7 * expected.abs().max()
    assert layer.weight_bytes() == 40 * 64 + 40 * 2


def test_block_layer_is_the_dequantized_weight_forward_and_backward():
    torch.manual_seed(2)
    w = torch.randn(48, 64)
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        layer = BlockQuantLinear.from_float(w, kind)
        dense = gguf.dequantize(quantize(w, kind), kind)
        x1 = torch.randn(2, 7, 64, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        y1, y2 = layer(x1), F.linear(x2, dense)
        assert torch.equal(y1, y2), kind
        g = torch.randn_like(y1)
        y1.backward(g)
        y2.backward(g)
        assert torch.equal(x1.grad, x2.grad), kind
        assert not any(p.requires_grad for p in layer.parameters())
        assert layer.weight_bytes() == quantize(w, kind).nbytes


def test_block_layer_saves_no_float_weight_for_backward():
    w = torch.randn(256, 512)
    layer = BlockQuantLinear.from_float(w, "Q4_1")
    saved = []
    x = torch.randn(1, 512, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        layer(x).sum().backward()
    assert sum(saved) == quantize(w, "Q4_1").nbytes  # the blocks only: 5 bits a weight, not 32
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        saved.clear()
        F.linear(x, w.requires_grad_(False)).sum().backward()
    assert sum(saved) >= w.nbytes  # the float layer keeps its float weight


def test_the_files_blocks_fill_the_models_rows(bundled):
    path, model, _ = bundled
    blocks = gguf_blocks(model, path)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(blocks) == sorted(n for n in linears if n != "head")  # the head is the Q8_0 token table
    for name, (b, kind) in blocks.items():
        assert kind == "Q4_1", name
        # the fused [Q; K; V] rows, in the half-split RoPE order: exactly the loader's floats
        assert torch.equal(gguf.dequantize(b, kind), model.get_submodule(name).weight), name


def test_the_bundled_model_on_the_int4_kernel(bundled):
    path, model, tokenizer = bundled
    quantized, _, _ = load_pretrained(path)
    names = int4_from_gguf(quantized, path)
    assert len(names) == 151 and isinstance(quantized.head, Int8Linear)
    assert isinstance(quantized.blocks[0].attn.qkv, Int4Linear)
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. "
                                         "The capital of Spain is")])
    with torch.no_grad():
        a = model(ids).logits[0].log_softmax(-1)
        b = quantized(ids).logits[0].log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1)  # (T,): nats, float32 model against the int4 one
    assert kl.mean() < 0.02, kl
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.85
    assert tokenizer.decode([int(b[-1].argmax())]).strip() == "Madrid"


def test_bad_arguments():
    with pytest.raises(ValueError, match="Q4_1 rows"):
        Int4Linear.from_q4_1(torch.zeros(4, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 64"):
        Int4Linear.from_q4_1(quantize(torch.randn(4, 32), "Q4_1"))
    with pytest.raises(ValueError, match="in_features=64"):
        Int4Linear.from_float(torch.randn(16, 64))(torch.randn(2, 32))
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        Int4Linear.from_float(torch.randn(8, 64))
    with pytest.raises(ValueError, match="kind"):
        BlockQuantLinear(torch.zeros(2, 34, dtype=torch.uint8), "Q5_0")
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_linears(nn.Sequential(nn.ReLU()), lambda name, lin: lin)
    with pytest.raises(ValueError, match="head"):
        int4_from_gguf(nn.Linear(2, 2), "x.gguf", head="int2")
