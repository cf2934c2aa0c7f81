"""tutorial_lib.attention against PyTorch's own attention, with and without masks."""

import math

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from tutorial_lib.attention import (
    KVCache,
    LayerKVCache,
    MultiHeadAttention,
    fused_attention,
    scaled_dot_product_attention,
)
from tutorial_lib.masks import causal_mask, key_padding_to_torch, padding_mask, to_blocked
from tutorial_lib.positions import RotaryEmbedding

ATOL = 1e-5


def random_mask(shape, p=0.3, generator=None):
    """A boolean mask (True = may attend) whose every row allows at least one key."""
    mask = torch.rand(shape, generator=generator) > p
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("h,h_kv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("T,S", [(5, 5), (3, 7), (7, 2)])
def test_written_out_matches_torch_sdpa(h, h_kv, T, S):
    B, d_k = 2, 8
    q, k, v = torch.randn(B, h, T, d_k), torch.randn(B, h_kv, S, d_k), torch.randn(B, h_kv, S, d_k)
    mask = random_mask((B, 1, T, S))
    ours, weights = scaled_dot_product_attention(q, k, v, mask)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != h_kv)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert weights.shape == (B, h, T, S)


def test_weights_rows_sum_to_one_and_masked_weights_are_exactly_zero():
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    mask = random_mask((2, 1, 4, 6))
    _, weights = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 4))
    assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()
    assert (weights.masked_select(mask.expand_as(weights)) > 0).all()


def test_fully_masked_row_gives_zeros_not_nan_on_both_paths():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False  # query 1 may attend to nothing
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    fast = fused_attention(q, k, v, mask)
    for o in (out, fast):
        assert not o.isnan().any()
        assert (o[:, :, 1] == 0).all()
        assert (o[:, :, 0].abs() > 0).any()
    assert (weights[:, :, 1] == 0).all()
    torch.testing.assert_close(out, fast, atol=ATOL, rtol=0)


def test_a_query_attends_to_the_only_allowed_key():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[False, True, False], [True, False, False]])
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 1])
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 0])


def test_scaling_is_one_over_sqrt_dk():
    # Two keys; the softmax of scaled scores is known in closed form.
    q = torch.tensor([[[[2.0, 0.0, 0.0, 0.0]]]])
    k = torch.tensor([[[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]])
    v = torch.tensor([[[[1.0], [0.0]]]])
    out, weights = scaled_dot_product_attention(q, k, v)
    expected = math.exp(2 / 2) / (math.exp(2 / 2) + 1)  # score 2 / sqrt(4) against 0
    assert weights[0, 0, 0, 0].item() == pytest.approx(expected, abs=1e-6)
    assert out.item() == pytest.approx(expected, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3), h_kv=st.integers(1, 3), group=st.integers(1, 3), T=st.integers(1, 9),
    S=st.integers(1, 9), d_k=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 10_000),
    use_mask=st.booleans(),
)
def test_property_written_out_equals_fused_and_torch(B, h_kv, group, T, S, d_k, seed, use_mask):
    g = torch.Generator().manual_seed(seed)
    h = h_kv * group
    q = torch.randn(B, h, T, d_k, generator=g)
    k, v = torch.randn(B, h_kv, S, d_k, generator=g), torch.randn(B, h_kv, S, d_k, generator=g)
    mask = random_mask((B, 1, T, S), generator=g) if use_mask else None
    ours, weights = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(ours, fused_attention(q, k, v, mask), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=group > 1),
        atol=ATOL, rtol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, h, T), atol=1e-6, rtol=0)


def copy_to_torch_mha(ours: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    ref = torch.nn.MultiheadAttention(ours.d_model, ours.n_heads, bias=ours.qkv.bias is not None,
                                      batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.out_proj.weight.copy_(ours.out.weight)
        if ours.qkv.bias is not None:
            ref.in_proj_bias.copy_(ours.qkv.bias)
            ref.out_proj.bias.copy_(ours.out.bias)
    return ref.eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_matches_nn_multiheadattention_with_both_masks(bias, need_weights):
    B, T, d, h = 3, 6, 32, 4
    ours = MultiHeadAttention(d, h, bias=bias).eval()
    ref = copy_to_torch_mha(ours)
    x = torch.randn(B, T, d)
    lengths = torch.tensor([6, 4, 2])
    keys_ok = padding_mask(lengths, T)  # (B, 1, 1, T), True = real token
    causal = causal_mask(T)  # (T, T), True = may attend
    out, weights = ours(x, mask=keys_ok & causal, need_weights=need_weights)
    # PyTorch's convention is the opposite: True = blocked. Convert at the boundary.
    expected, expected_w = ref(x, x, x, key_padding_mask=key_padding_to_torch(keys_ok),
                               attn_mask=to_blocked(causal), need_weights=True,
                               average_attn_weights=False)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    if need_weights:
        torch.testing.assert_close(weights, expected_w, atol=ATOL, rtol=0)
    else:
        assert weights is None


def test_cross_attention_matches_nn_multiheadattention_with_t_not_s():
    B, T, S, d, h = 2, 3, 7, 24, 3
    ours = MultiHeadAttention(d, h).eval()
    ref = copy_to_torch_mha(ours)
    x, memory = torch.randn(B, T, d), torch.randn(B, S, d)
    src_ok = padding_mask(torch.tensor([7, 5]), S)
    out, _ = ours(x, memory, mask=src_ok)
    expected, _ = ref(x, memory, memory, key_padding_mask=key_padding_to_torch(src_ok))
    assert out.shape == (B, T, d)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_fast_path_and_written_out_path_agree(n_kv_heads):
    mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads).eval()
    x = torch.randn(2, 5, 32)
    mask = random_mask((2, 1, 5, 5))
    fast, none = mha(x, mask=mask)
    slow, weights = mha(x, mask=mask, need_weights=True)
    assert none is None and weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(fast, slow, atol=ATOL, rtol=0)
    causal_fast, _ = mha(x, is_causal=True)
    causal_slow, w = mha(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(causal_fast, causal_slow, atol=ATOL, rtol=0)
    assert (w.triu(1) == 0).all()


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_weights():
    d, h, h_kv, d_k = 32, 4, 2, 8
    gqa = MultiHeadAttention(d, h, n_kv_heads=h_kv, bias=False).eval()
    mha = MultiHeadAttention(d, h, bias=False).eval()
    w_q, w_k, w_v = gqa.qkv.weight.split([h * d_k, h_kv * d_k, h_kv * d_k])
    # each kv head serves h / h_kv consecutive query heads
    repeat = lambda w: w.view(h_kv, d_k, d).repeat_interleave(h // h_kv, dim=0).reshape(h * d_k, d)
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([w_q, repeat(w_k), repeat(w_v)]))
        mha.out.weight.copy_(gqa.out.weight)
    x = torch.randn(2, 6, d)
    torch.testing.assert_close(gqa(x, is_causal=True).out, mha(x, is_causal=True).out,
                               atol=ATOL, rtol=0)
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())


def test_self_attention_without_positions_is_permutation_equivariant():
    mha = MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 7, 16)
    perm = torch.randperm(7)
    out = mha(x).out
    torch.testing.assert_close(mha(x[:, perm]).out, out[:, perm], atol=ATOL, rtol=0)
    # and a causal mask breaks the symmetry: it is a statement about positions
    assert not torch.allclose(mha(x[:, perm], is_causal=True).out, mha(x, is_causal=True).out[:, perm])


def test_cached_self_attention_equals_full_causal_attention():
    mha = MultiHeadAttention(32, 4, n_kv_heads=2).eval()
    x = torch.randn(2, 6, 32)
    full = mha(x, is_causal=True).out
    cache = LayerKVCache()
    prefill = mha(x[:, :3], is_causal=True, cache=cache).out
    steps = [mha(x[:, t : t + 1], is_causal=True, cache=cache).out for t in range(3, 6)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=ATOL, rtol=0)
    assert len(cache) == 6


def test_cross_attention_cache_projects_the_context_once():
    mha = MultiHeadAttention(16, 2).eval()
    x, memory = torch.randn(1, 4, 16), torch.randn(1, 5, 16)
    full = mha(x, memory).out
    cache = LayerKVCache()
    first = mha(x[:, :1], memory, cache=cache).out
    keys = cache.keys
    # the second call must reuse the stored keys: give it a different memory to prove it
    second = mha(x[:, 1:], torch.zeros_like(memory), cache=cache).out
    assert cache.keys.data_ptr() == keys.data_ptr() and torch.equal(cache.keys, keys) and len(cache) == 5
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=ATOL, rtol=0)


def test_cache_appends_in_place_and_grows_without_changing_its_contents():
    cache = LayerKVCache()
    parts = [torch.randn(2, 3, n, 4) for n in (5, 1, 1, 7, 1, 20)]
    buffers = set()
    for i, k in enumerate(parts):
        keys, values = cache.append(k, -k)
        expected = torch.cat(parts[: i + 1], dim=-2)  # what appending by concatenation would hold
        assert torch.equal(keys, expected) and torch.equal(values, -expected), f"contents wrong after append {i}"
        assert len(cache) == expected.size(-2) and cache.nbytes() == 2 * expected.numel() * 4  # filled part only
        buffers.add(cache.keys.data_ptr())
    assert len(buffers) < len(parts), "appending one position must not copy the cache every time"
    cache.select(torch.tensor([1, 1, 0]))  # beam search: keep sequences 1, 1 and 0
    assert torch.equal(cache.keys, torch.cat(parts, dim=-2)[[1, 1, 0]]), "select must keep sequences 1, 1, 0"
    with pytest.raises(ValueError, match="do not fit"):
        cache.append(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    with pytest.raises(ValueError, match="differ from the new keys"):  # would broadcast into the buffer
        cache.append(torch.randn(3, 3, 1, 4), torch.randn(1, 3, 1, 4))


def test_cache_with_capacity_allocates_once_and_keeps_every_position():
    cache = LayerKVCache(capacity=8)
    k = torch.randn(2, 3, 8, 4)
    cache.append(k[:, :, :3], -k[:, :, :3])  # a 3-position prompt, then single steps
    buffer = cache.keys.data_ptr()
    for t in range(3, 8):
        keys, values = cache.append(k[:, :, t : t + 1], -k[:, :, t : t + 1])
    assert cache.keys.data_ptr() == buffer, "a cache with room for max_len positions must never move"
    assert torch.equal(keys, k) and torch.equal(values, -k) and len(cache) == 8, "cached keys/values differ"
    cache.append(k[:, :, :1], k[:, :, :1])  # past the capacity it grows as a cache without one
    assert len(cache) == 9 and torch.equal(cache.keys[:, :, :8], k), "growing past capacity lost positions"


def test_kv_cache_counts_positions_and_bytes():
    cache = KVCache(3)
    assert len(cache) == 0
    for layer in cache.layers:
        layer.append(torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 5, 8))
    assert len(cache) == 5
    assert cache.nbytes() == 3 * 2 * (2 * 4 * 5 * 8) * 4


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,mask,match",
    [
        ((2, 4, 8), (2, 1, 4, 8), (2, 1, 4, 8), None, "q must have 4 dimensions"),
        ((2, 1, 3, 8), (2, 1, 4, 6), (2, 1, 4, 6), None, "same d_k"),
        ((2, 1, 3, 8), (3, 1, 4, 8), (3, 1, 4, 8), None, "batch sizes differ"),
        ((2, 3, 3, 8), (2, 2, 4, 8), (2, 2, 4, 8), None, "multiple of the key/value heads"),
        ((2, 1, 3, 8), (2, 1, 4, 8), (2, 1, 5, 8), None, "same heads and length"),
        ((2, 1, 3, 8), (2, 1, 4, 8), (2, 1, 4, 8), torch.ones(3, 5, dtype=torch.bool),
         "does not broadcast"),
        ((2, 1, 3, 8), (2, 1, 4, 8), (2, 1, 4, 8), torch.zeros(3, 4), "must be boolean"),
    ],
)
def test_bad_inputs_raise_clear_errors(q_shape, k_shape, v_shape, mask, match):
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    with pytest.raises(ValueError, match=match):
        scaled_dot_product_attention(q, k, v, mask)
    with pytest.raises(ValueError, match=match):
        fused_attention(q, k, v, mask)


def test_module_configuration_errors():
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be divisible by n_kv_heads \(4\)"):
        MultiHeadAttention(48, 6, n_kv_heads=4)
    mha = MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=16\)"):
        mha(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="context must have shape"):
        mha(torch.randn(2, 5, 16), torch.randn(3, 4, 16))


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_cached_rope_attention_gives_the_bits_of_project_then_rotate(n_kv_heads):
    # the module splits its projection into heads once and rotates queries and keys together
    # (fewer operations per decoding step); it must give exactly what the documented parts
    # give: project, RotaryEmbedding's forward, the cache, fused attention, the output matrix
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads, rotary=RotaryEmbedding(8)).eval()
    cache, keys, values = LayerKVCache(), None, None
    for start, T in ((0, 5), (5, 1), (6, 1), (7, 3)):
        x = torch.randn(2, T, 32)
        q, k, v = mha.project(x)
        q, k = mha.rotary(q, k, start)
        keys = k if keys is None else torch.cat([keys, k], dim=2)
        values = v if values is None else torch.cat([values, v], dim=2)
        out = fused_attention(q, keys, values, is_causal=True)  # (B, h, T, d_k)
        expected = mha.out(out.transpose(1, 2).reshape(2, T, 32))
        got = mha(x, is_causal=True, cache=cache).out
        assert torch.equal(got, expected), f"step at position {start} ({T} new) differs from project + rotate"
