"""Masks: what each one allows, checked against hand-written expectations and against the
conventions of PyTorch's own attention entry points."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from tutorial_lib.attention import scaled_dot_product_attention
from tutorial_lib.masks import (
    causal_mask,
    combine,
    cross_mask,
    from_additive,
    from_blocked,
    key_padding_to_torch,
    padding_mask,
    prefix_lm_mask,
    sliding_window_mask,
    to_additive,
    to_blocked,
)


def bools(rows):
    return torch.tensor(rows, dtype=torch.bool)


def qkv(B=2, h=2, T=4, S=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, T, d, generator=g), torch.randn(B, h, S, d, generator=g),
            torch.randn(B, h, S, d, generator=g))


# ---- causal -----------------------------------------------------------------------------------

def test_causal_mask_square_is_the_hand_written_lower_triangle():
    assert torch.equal(causal_mask(3), bools([[1, 0, 0],
                                              [1, 1, 0],
                                              [1, 1, 1]]))


def test_causal_mask_with_cached_keys_is_aligned_bottom_right():
    # 2 new queries at positions 2 and 3, 4 keys (two of them cached)
    expected = bools([[1, 1, 1, 0],
                      [1, 1, 1, 1]])
    assert torch.equal(causal_mask(2, 4), expected)
    assert torch.equal(causal_mask(2, 4), causal_mask(4)[-2:])
    # PyTorch's own name for this alignment
    assert torch.equal(causal_mask(3, 7), causal_lower_right(3, 7)._materialize())


def test_causal_mask_matches_pytorch_is_causal_and_generate_square_subsequent_mask():
    q, k, v = qkv(T=5, S=5)
    ours = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(5))
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, theirs)
    # nn.Transformer's float mask is the additive form of ours
    assert torch.equal(to_additive(causal_mask(5)), torch.nn.Transformer.generate_square_subsequent_mask(5))


def test_causal_outputs_do_not_depend_on_later_keys():
    q, k, v = qkv(T=5, S=5)
    out, weights = scaled_dot_product_attention(q, k, v, causal_mask(5))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3:], v2[:, :, 3:] = 100.0, -100.0  # change keys and values at positions 3 and 4
    out2, _ = scaled_dot_product_attention(q, k2, v2, causal_mask(5))
    torch.testing.assert_close(out2[:, :, :3], out[:, :, :3])
    assert not torch.allclose(out2[:, :, 3:], out[:, :, 3:])
    assert torch.equal(weights.triu(1), torch.zeros_like(weights))


@pytest.mark.parametrize("bad", [lambda: causal_mask(0), lambda: causal_mask(4, 3),
                                 lambda: causal_mask(2.0), lambda: causal_mask(True)])
def test_causal_mask_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="T|S"):
        bad()


# ---- padding and cross ------------------------------------------------------------------------

def test_padding_mask_from_lengths_and_from_ids_agree_with_the_hand_written_mask():
    expected = bools([[1, 1, 1, 1],
                      [1, 1, 0, 0],
                      [0, 0, 0, 0]])[:, None, None, :]  # (B, 1, 1, S)
    assert torch.equal(padding_mask(torch.tensor([4, 2, 0]), 4), expected)
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0], [0, 0, 0, 0]])
    assert torch.equal(padding_mask(ids, pad_id=0), expected)
    assert torch.equal(padding_mask(ids, 4, pad_id=0), expected)
    assert padding_mask(torch.tensor([3, 1])).shape == (2, 1, 1, 3)  # S defaults to the longest


def test_padded_keys_get_zero_weight_and_do_not_change_the_output():
    q, k, v = qkv(B=2, T=3, S=5)
    keep = padding_mask(torch.tensor([5, 3]), 5)
    out, weights = scaled_dot_product_attention(q, k, v, keep)
    assert torch.equal(weights[1, :, :, 3:], torch.zeros(2, 3, 2))
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 3:], v2[1, :, 3:] = 50.0, 50.0
    torch.testing.assert_close(scaled_dot_product_attention(q, k2, v2, keep).out, out)


def test_key_padding_to_torch_gives_nn_multiheadattention_the_same_answer():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    keep = padding_mask(torch.tensor([5, 3]), 5)
    assert torch.equal(key_padding_to_torch(keep), bools([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]))
    with torch.no_grad():
        ref, _ = mha(x[1:, :3], x[1:, :3], x[1:, :3])  # sequence 1 without its padding at all
        out, _ = mha(x, x, x, key_padding_mask=key_padding_to_torch(keep))
    torch.testing.assert_close(out[1:, :3], ref)


@pytest.mark.parametrize("bad, message", [
    (lambda: padding_mask(torch.tensor([2.0, 1.0]), 3), "integer lengths"),
    (lambda: padding_mask(torch.tensor([4, 1]), 3), r"lie in \[0, S=3\]"),
    (lambda: padding_mask(torch.tensor([[1, 2]]), 3), "integer lengths"),
    (lambda: padding_mask(torch.tensor([1, 2]), 3, pad_id=0), r"ids of shape \(B, S\)"),
    (lambda: padding_mask(torch.tensor([[1, 0]]), 3, pad_id=0), "does not match"),
])
def test_padding_mask_rejects_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_cross_mask_is_the_outer_and_of_target_and_source_flags():
    target = bools([[1, 1], [1, 0]])          # example 1: one real target token
    source = bools([[1, 1, 1], [1, 1, 0]])    # example 1: two real source tokens
    expected = bools([[[1, 1, 1],
                       [1, 1, 1]],
                      [[1, 1, 0],
                       [0, 0, 0]]])[:, None]  # (B, 1, T, S)
    assert torch.equal(cross_mask(target, source), expected)
    with pytest.raises(ValueError, match="batch sizes differ"):
        cross_mask(target, source[:1])
    with pytest.raises(ValueError, match=r"target_keep \(B, T\)"):
        cross_mask(target[0], source)


def test_a_fully_masked_row_gives_zeros_in_the_library_and_nan_in_a_naive_softmax():
    q, k, v = qkv(B=2, T=2, S=3)
    mask = cross_mask(bools([[1, 1], [1, 0]]), bools([[1, 1, 1], [1, 1, 0]]))
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[1, :, 1], torch.zeros(2, 8)) and torch.equal(weights[1, :, 1], torch.zeros(2, 3))
    assert torch.isfinite(out).all()
    naive = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf")).softmax(-1)
    assert torch.isnan(naive[1, :, 1]).all() and not torch.isnan(naive[0]).any()


# ---- prefix-LM and sliding window -------------------------------------------------------------

def test_prefix_lm_mask_is_bidirectional_inside_the_prefix_and_causal_after_it():
    assert torch.equal(prefix_lm_mask(2, 4), bools([[1, 1, 0, 0],
                                                     [1, 1, 0, 0],
                                                     [1, 1, 1, 0],
                                                     [1, 1, 1, 1]]))
    assert torch.equal(prefix_lm_mask(0, 4), causal_mask(4))
    assert torch.equal(prefix_lm_mask(1, 4), causal_mask(4))  # one token sees only itself anyway
    assert torch.equal(prefix_lm_mask(4, 4), torch.ones(4, 4, dtype=torch.bool))


def test_prefix_lm_mask_per_example_matches_the_int_version_row_by_row():
    lengths = torch.tensor([0, 2, 3])
    batched = prefix_lm_mask(lengths, 4)
    assert batched.shape == (3, 1, 4, 4)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(batched[b, 0], prefix_lm_mask(n, 4))
    with pytest.raises(ValueError, match=r"prefix lengths must lie in \[0, T=4\]"):
        prefix_lm_mask(torch.tensor([5]), 4)
    with pytest.raises(ValueError, match="prefix_len must be an int"):
        prefix_lm_mask(-1, 4)


def test_sliding_window_mask_keeps_the_last_window_keys_of_each_query():
    assert torch.equal(sliding_window_mask(5, 2), bools([[1, 0, 0, 0, 0],
                                                         [1, 1, 0, 0, 0],
                                                         [0, 1, 1, 0, 0],
                                                         [0, 0, 1, 1, 0],
                                                         [0, 0, 0, 1, 1]]))
    assert torch.equal(sliding_window_mask(5, 1), torch.eye(5, dtype=torch.bool))
    assert torch.equal(sliding_window_mask(5, 5), causal_mask(5))
    assert torch.equal(sliding_window_mask(2, 3, S=6), sliding_window_mask(6, 3)[-2:])
    assert (sliding_window_mask(8, 3).sum(-1) <= 3).all()
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(5, 0)


# ---- combining and converting -----------------------------------------------------------------

def test_combine_is_a_broadcast_logical_and_that_skips_none():
    causal = causal_mask(3)                                    # (T, S)
    keep = padding_mask(torch.tensor([3, 2]), 3)               # (B, 1, 1, S)
    both = combine(causal, None, keep)
    assert both.shape == (2, 1, 3, 3)
    assert torch.equal(both[0, 0], causal)
    assert torch.equal(both[1, 0], bools([[1, 0, 0], [1, 1, 0], [1, 1, 0]]))
    assert combine(None, None) is None
    assert combine(causal) is causal


@pytest.mark.parametrize("bad, message", [
    (lambda: combine(causal_mask(3), torch.ones(3, 3)), "boolean masks"),
    (lambda: combine(causal_mask(3), causal_mask(4)), "broadcast together"),
])
def test_combine_rejects_non_boolean_and_non_broadcastable_masks(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_to_blocked_is_what_nn_multiheadattention_expects_in_attn_mask():
    torch.manual_seed(1)
    mha = torch.nn.MultiheadAttention(8, 1, batch_first=True, bias=False).eval()
    x = torch.randn(1, 4, 8)
    allowed = sliding_window_mask(4, 2)
    with torch.no_grad():
        _, torch_weights = mha(x, x, x, attn_mask=to_blocked(allowed))
        _, flipped_weights = mha(x, x, x, attn_mask=allowed)  # the classic mistake
    assert torch.equal(torch_weights[0] > 0, allowed)
    assert torch.equal(flipped_weights[0] > 0, ~allowed)  # it attended to exactly the blocked keys
    assert torch.equal(from_blocked(to_blocked(allowed)), allowed)
    with pytest.raises(ValueError, match="boolean"):
        to_blocked(allowed.float())


def test_additive_masks_round_trip_and_give_sdpa_the_same_answer():
    mask = combine(causal_mask(4), padding_mask(torch.tensor([4, 3]), 4))
    additive = to_additive(mask)
    assert set(additive.unique().tolist()) == {0.0, float("-inf")}
    assert torch.equal(from_additive(additive), mask)
    q, k, v = qkv(T=4, S=4)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    # Hugging Face models add the dtype's minimum instead of -inf; that is blocked too
    hf_style = torch.zeros(2, 2).masked_fill(~bools([[1, 0], [1, 1]]), torch.finfo(torch.float32).min)
    assert torch.equal(from_additive(hf_style), bools([[1, 0], [1, 1]]))
    with pytest.raises(ValueError, match="floating-point"):
        from_additive(mask)


# ---- the graded exercises of notebook 02 agree with the library ------------------------------

def test_exercise_references_of_notebook_02_agree_with_the_library():
    from tutorial_lib.exercises import reference

    lengths = torch.tensor([4, 2, 1])
    expected = combine(causal_mask(4), padding_mask(lengths, 4))
    assert torch.equal(reference("02.decoder_self_mask")(lengths, 4), expected)
    for T, S in ((1, 5), (3, 5), (4, 4)):   # queries in the last T slots: the library's cached mask
        assert torch.equal(reference("02.cached_causal_mask")(torch.arange(S - T, S), S), causal_mask(T, S))
    # queries anywhere in a pre-allocated cache: their rows of the full S x S causal mask
    assert torch.equal(reference("02.cached_causal_mask")(torch.tensor([3, 4]), 8), causal_mask(8)[3:5])
    q, k, v = qkv(B=2, T=3, S=5)
    mask = cross_mask(bools([[1, 1, 1], [1, 1, 0]]), bools([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    _, weights = scaled_dot_product_attention(q, k, v, mask)
    scores = q @ k.transpose(-2, -1) / 8 ** 0.5
    torch.testing.assert_close(reference("02.masked_softmax")(scores, mask.expand_as(scores)), weights)
