"""The numerics of the two attention paths: empty rows (no allowed key) give zero outputs and
finite gradients, with and without a bias, in float32 and under CPU autocast bf16; the
written-out path computes in float32 and agrees with the fused one; 3-D masks are refused;
additive masks are read with a documented threshold."""

import math

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from tutorial_lib.attention import MultiHeadAttention, fused_attention, scaled_dot_product_attention
from tutorial_lib.masks import ADDITIVE_BLOCKED_AT, from_additive, to_additive

BF16_TOL = dict(atol=3e-2, rtol=2e-2)  # a few bf16 roundings of values of size ~1 (2^-8 relative each)


def autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def qkv_with_grad(g, B=2, h=4, h_kv=2, T=5, S=6, d_k=8):
    return [torch.randn(B, n_heads, n, d_k, generator=g).requires_grad_()
            for n_heads, n in ((h, T), (h_kv, S), (h_kv, S))]


def mask_with_empty_rows(g, B=2, T=5, S=6):
    """(B, 1, T, S): random, with query 1 of example 0 and query 3 of example 1 allowed nothing."""
    mask = torch.rand(B, 1, T, S, generator=g) > 0.4
    mask[..., 0] = True
    mask[0, 0, 1] = False
    mask[1, 0, 3] = False
    return mask


def written_out(q, k, v, mask, bias):
    return scaled_dot_product_attention(q, k, v, mask, bias=bias).out


def fused(q, k, v, mask, bias):
    return fused_attention(q, k, v, mask, bias=bias)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("path", [written_out, fused], ids=["written-out", "fused"])
def test_empty_rows_give_zero_output_and_finite_gradients(path, precision, with_bias):
    g = torch.Generator().manual_seed(0)
    q, k, v = qkv_with_grad(g)
    mask = mask_with_empty_rows(g)
    bias = torch.randn(1, 4, 5, 6, generator=g) if with_bias else None
    with autocast(precision == "bf16-autocast"):
        out = path(q, k, v, mask, bias)
        (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    assert torch.isfinite(out).all(), "attention output holds a NaN or infinity"
    assert (out[0, :, 1] == 0).all() and (out[1, :, 3] == 0).all(), "an empty row's output is not zero"
    assert (out[0, :, 0] != 0).any(), "a row with allowed keys was zeroed too"
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"the gradient of {name} holds a NaN or infinity"
    # an empty row's output is a constant 0: nothing flows back into its query
    assert (q.grad[0, :, 1] == 0).all() and (q.grad[1, :, 3] == 0).all(), "an empty row's query got a gradient"


def nan_for_empty_rows_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, **_):
    """A stand-in for a backend that returns NaN for a row with no allowed key (as some
    GPU kernels and versions do): a plain softmax over the masked scores."""
    k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    return scores.softmax(-1) @ v  # softmax of an all -inf row: NaN


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_fused_path_never_hands_the_kernel_an_empty_row(monkeypatch, with_bias):
    """Zeroing the output after a kernel that returned NaN would leave NaN in dV (the mask is
    made safe before the kernel instead): with a NaN-returning kernel, everything stays finite."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", nan_for_empty_rows_sdpa)
    g = torch.Generator().manual_seed(1)
    q, k, v = qkv_with_grad(g)
    mask = mask_with_empty_rows(g)
    bias = torch.randn(1, 4, 5, 6, generator=g) if with_bias else None
    naive = nan_for_empty_rows_sdpa(q.detach(), k.detach(), v.detach(), mask)
    assert naive.isnan().any(), "the stand-in kernel should give NaN for an empty row"
    out = fused_attention(q, k, v, mask, bias=bias)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[0, :, 1] == 0).all()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"d{name} holds a NaN: the empty row reached the kernel"


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_written_out_fused_and_module_agree_in_float32_with_empty_rows(with_bias):
    g = torch.Generator().manual_seed(2)
    q, k, v = qkv_with_grad(g)
    mask = mask_with_empty_rows(g)
    bias = torch.randn(1, 4, 5, 6, generator=g) if with_bias else None
    results = []
    for path in (written_out, fused):
        for t in (q, k, v):
            t.grad = None
        out = path(q, k, v, mask, bias)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        results.append([out.detach()] + [t.grad.clone() for t in (q, k, v)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"{name} differs between the two paths")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_multi_head_attention_paths_agree_with_empty_rows(precision, with_bias):
    torch.manual_seed(3)
    mha = MultiHeadAttention(16, 4, n_kv_heads=2)
    x = torch.randn(2, 5, 16)
    mask = mask_with_empty_rows(torch.Generator().manual_seed(3))[..., :5]
    mask[0, 0, 1] = mask[1, 0, 3] = False
    bias = torch.randn(1, 4, 5, 5) if with_bias else None
    outs, grads = [], []
    for need_weights in (False, True):
        mha.zero_grad()
        xx = x.clone().requires_grad_()
        with autocast(precision == "bf16-autocast"):
            out, weights = mha(xx, mask=mask, bias=bias, need_weights=need_weights)
            out.float().square().sum().backward()
        assert torch.isfinite(out).all(), "MultiHeadAttention's output holds a NaN"
        for name, p in [("x", xx)] + list(mha.named_parameters()):
            assert torch.isfinite(p.grad).all(), f"the gradient of {name} is not finite (need_weights={need_weights})"
        outs.append(out.float())
        grads.append(mha.qkv.weight.grad.clone())
    tol = dict(atol=1e-5, rtol=1e-4) if precision == "fp32" else BF16_TOL
    torch.testing.assert_close(outs[0], outs[1], **tol, msg="the fused and written-out module paths differ")
    if precision == "fp32":
        torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    # an empty row's attention output is 0, so the block's output there is out_proj's bias alone
    torch.testing.assert_close(outs[0][0, 1], mha.out.bias.detach().float().expand(16), **tol)


def test_written_out_path_runs_scores_and_softmax_in_float32_and_casts_back():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) * 4 for _ in range(3))
    mask = torch.rand(1, 1, 6, 6, generator=g) > 0.3
    mask[..., 0] = True
    lo = [t.bfloat16() for t in (q, k, v)]
    out, weights = scaled_dot_product_attention(*lo, mask)
    out32, weights32 = scaled_dot_product_attention(*(t.float() for t in lo), mask)
    assert out.dtype == weights.dtype == torch.bfloat16
    assert torch.equal(out, out32.bfloat16()) and torch.equal(weights, weights32.bfloat16()), \
        "bf16 inputs were not computed in float32 and rounded once at the end"
    with autocast(True):  # float32 inputs: rounded to bf16 as autocast would, then float32
        out_ac, weights_ac = scaled_dot_product_attention(q, k, v, mask)
    assert out_ac.dtype == torch.bfloat16
    assert torch.equal(out_ac, out) and torch.equal(weights_ac, weights)


def test_under_autocast_the_written_out_path_is_as_close_to_exact_as_the_fused_one():
    g = torch.Generator().manual_seed(5)
    B, h, T, d_k = 2, 4, 48, 16
    q, k, v = (torch.randn(B, h, T, d_k, generator=g) * 3 for _ in range(3))
    mask = torch.rand(B, 1, T, T, generator=g) > 0.3
    mask[..., 0] = True
    rounded = [t.bfloat16().double() for t in (q, k, v)]  # what autocast hands the kernels
    scores = (rounded[0] @ rounded[1].transpose(-2, -1) / math.sqrt(d_k)).masked_fill(~mask, float("-inf"))
    exact = scores.softmax(-1) @ rounded[2]
    with autocast(True):
        ours = scaled_dot_product_attention(q, k, v, mask).out
        theirs = fused_attention(q, k, v, mask)
    err_ours = (ours.double() - exact).abs().max().item()
    err_fused = (theirs.double() - exact).abs().max().item()
    ulp = 2.0 ** -8 * exact.abs().max().item()  # one bf16 rounding at the largest output
    assert err_ours <= 2 * ulp, f"the written-out path is {err_ours:.3g} from exact (one bf16 step: {ulp:.3g})"
    assert err_ours <= err_fused + ulp, f"written-out error {err_ours:.3g} vs fused {err_fused:.3g}"


# ---- property tests ---------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), group=st.integers(1, 2), T=st.integers(1, 6),
       S=st.integers(1, 6), blocked=st.floats(0.0, 1.0), with_bias=st.booleans(),
       seed=st.integers(0, 10_000))
def test_property_random_masks_with_empty_rows_never_give_nan(B, h_kv, group, T, S, blocked, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    h = h_kv * group
    q, k, v = qkv_with_grad(g, B=B, h=h, h_kv=h_kv, T=T, S=S, d_k=4)
    mask = torch.rand(B, 1, T, S, generator=g) >= blocked  # blocked near 1: many empty rows
    bias = torch.randn(1, h, T, S, generator=g) if with_bias else None
    empty = ~mask.any(-1)  # (B, 1, T)
    results = {}
    for precision in ("fp32", "bf16-autocast"):
        for path in (written_out, fused):
            for t in (q, k, v):
                t.grad = None
            with autocast(precision == "bf16-autocast"):
                out = path(q, k, v, mask, bias)
                out.float().sum().backward()
            name = f"{path.__name__} {precision}"
            assert torch.isfinite(out).all(), f"{name}: NaN in the output"
            assert (out.float().masked_select(empty[..., None].expand(out.shape)) == 0).all(), \
                f"{name}: an empty row's output is not zero"
            for grad_name, t in (("q", q), ("k", k), ("v", v)):
                assert torch.isfinite(t.grad).all(), f"{name}: NaN in the gradient of {grad_name}"
            results[name] = [out.detach().float()] + [t.grad.clone() for t in (q, k, v)]
    for a, b in zip(results["written_out fp32"], results["fused fp32"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(results["written_out bf16-autocast"][0], results["fused bf16-autocast"][0],
                               **BF16_TOL)


# ---- which masks are refused -----------------------------------------------------------------

def test_a_3d_mask_is_refused_because_its_batch_axis_would_line_up_with_heads():
    g = torch.Generator().manual_seed(6)
    B = h = 2
    q, k, v = (torch.randn(B, h, 3, 4, generator=g) for _ in range(3))
    per_example = torch.ones(B, 3, 3, dtype=torch.bool)
    per_example[1, :, 2] = False  # example 1's key 2 is padding
    for path in (scaled_dot_product_attention, fused_attention):
        with pytest.raises(ValueError, match=r"3-D mask .*mask\[:, None\]"):
            path(q, k, v, per_example)
        with pytest.raises(ValueError, match=r"3-D bias .*bias\[None\]"):
            path(q, k, v, bias=torch.zeros(h, 3, 3))
    # with the head axis added, example b gets its own mask in every head
    out, weights = scaled_dot_product_attention(q, k, v, per_example[:, None])
    assert (weights[1, :, :, 2] == 0).all(), "example 1's padded key got weight in some head"
    assert (weights[0, :, :, 2] > 0).all(), "example 0's key 2 was blocked by example 1's mask"
    torch.testing.assert_close(fused_attention(q, k, v, per_example[:, None]), out, atol=1e-6, rtol=0)


def test_a_2d_key_padding_mask_is_refused_with_the_reshape_that_fixes_it():
    q, k, v = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    with pytest.raises(ValueError, match=r"\(B, S\) key-padding mask needs mask\[:, None, None, :\]"):
        fused_attention(q, k, v, torch.ones(3, 5, dtype=torch.bool))


# ---- additive masks ------------------------------------------------------------------------------

@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min, -1e9, -1e4, ADDITIVE_BLOCKED_AT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_from_additive_blocks_every_common_fill_value(fill, dtype):
    allowed = torch.tensor([[True, False, True], [False, True, True]])
    additive = torch.zeros(2, 3).masked_fill(~allowed, max(fill, torch.finfo(dtype).min)).to(dtype)
    assert torch.equal(from_additive(additive), allowed), f"fill {fill} in {dtype} was not read as blocked"
    assert torch.equal(from_additive(to_additive(allowed, dtype)), allowed)


@pytest.mark.parametrize("value", [-1.0, -999.0, 0.5, float("inf"), float("nan")])
def test_from_additive_refuses_a_bias_that_is_not_a_mask(value):
    with pytest.raises(ValueError, match="bias, not a mask"):
        from_additive(torch.tensor([0.0, -1e9, value]))
