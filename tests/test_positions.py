"""Position schemes: the published formulas, checked against independent computations and
against Hugging Face's LLaMA (RoPE) and BLOOM (ALiBi) code, built from configs, never downloaded."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tutorial_lib.positions import (
    LearnedPositions,
    RotaryEmbedding,
    SinusoidalPositions,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rotate_half,
    sinusoidal_table,
)

# ---- sinusoidal -------------------------------------------------------------------------------


@pytest.mark.parametrize("T, d", [(7, 4), (50, 16), (3, 2)])
def test_sinusoidal_table_is_the_published_formula_entry_by_entry(T, d):
    expected = torch.tensor([[math.sin(p / 10000 ** (j / d)) if j % 2 == 0
                              else math.cos(p / 10000 ** ((j - 1) / d)) for j in range(d)]
                             for p in range(T)])
    torch.testing.assert_close(sinusoidal_table(T, d), expected, atol=1e-6, rtol=0)


def test_sinusoidal_rows_of_a_shift_are_a_fixed_rotation_of_each_pair():
    d, k = 8, 5
    table = sinusoidal_table(40, d).double()
    for i in range(d // 2):
        w = 1 / 10000 ** (2 * i / d)
        rotation = torch.tensor([[math.cos(k * w), math.sin(k * w)],
                                 [-math.sin(k * w), math.cos(k * w)]], dtype=torch.float64)
        pair = table[:, 2 * i: 2 * i + 2]                 # (T, 2): (sin, cos) of p*w
        torch.testing.assert_close(pair[:-k] @ rotation.T, pair[k:], atol=1e-5, rtol=0)


def test_sinusoidal_positions_return_the_offset_rows_and_stop_at_max_len():
    positions = SinusoidalPositions(10, 6)
    assert list(positions.parameters()) == []
    torch.testing.assert_close(positions(3, offset=4), sinusoidal_table(10, 6)[4:7])
    with pytest.raises(ValueError, match="positions 8..10 requested, but the table holds 10"):
        positions(3, offset=8)


@pytest.mark.parametrize("T, d", [(0, 4), (4, 3), (4, 0), (2.5, 4)])
def test_sinusoidal_table_rejects_bad_sizes(T, d):
    with pytest.raises(ValueError, match="T|d"):
        sinusoidal_table(T, d)


# ---- learned ----------------------------------------------------------------------------------

def test_learned_positions_are_rows_of_a_trainable_table_with_a_hard_limit():
    positions = LearnedPositions(6, 4)
    torch.testing.assert_close(positions(2, offset=3), positions.embedding.weight[3:5])
    positions(2, offset=3).sum().backward()
    used = positions.embedding.weight.grad.abs().sum(-1) > 0
    assert used.tolist() == [False, False, False, True, True, False], "only the used rows learn"
    with pytest.raises(ValueError, match="length 6 has no vector for positions 6..7"):
        positions(8)
    with pytest.raises(ValueError, match="offset"):
        positions(2, offset=-1)


# ---- RoPE -------------------------------------------------------------------------------------

def llama_rope(head_dim, base, positions, q, k):
    """Hugging Face's LLaMA rotary embedding, built from a config (nothing downloaded)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    n_heads = q.size(1)
    config = LlamaConfig(hidden_size=head_dim * n_heads, num_attention_heads=n_heads,
                         num_key_value_heads=k.size(1), max_position_embeddings=4096,
                         rope_theta=base)
    config.rope_parameters = {"rope_type": "default", "rope_theta": base}
    rotary = llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(q, positions[None].expand(q.size(0), -1))  # (B, T, d_k) each
    return llama.apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("head_dim, base, offset", [(8, 10000.0, 0), (16, 10000.0, 5), (64, 500000.0, 100)])
def test_rope_equals_hugging_face_llama(head_dim, base, offset):
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 4, 6, head_dim, generator=g)
    k = torch.randn(2, 2, 6, head_dim, generator=g)   # grouped-query: fewer key heads
    ours_q, ours_k = RotaryEmbedding(head_dim, base)(q, k, offset=offset)
    hf_q, hf_k = llama_rope(head_dim, base, torch.arange(offset, offset + 6), q, k)
    torch.testing.assert_close(ours_q, hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, hf_k, atol=1e-5, rtol=1e-5)


def test_rotate_half_pairs_dimension_i_with_i_plus_half():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0])
    assert rotate_half(x).tolist() == [-10.0, -20.0, -30.0, 1.0, 2.0, 3.0]
    # a quarter turn on every pair: (x_i, x_{i+d/2}) -> (-x_{i+d/2}, x_i)
    angle = torch.full((1, 6), math.pi / 2)
    torch.testing.assert_close(apply_rope(x[None], angle.cos(), angle.sin()), rotate_half(x)[None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,offset", [(1, 0), (1, 37), (16, 0), (9, 100)])
def test_rotary_module_gives_the_bits_of_apply_rope(dtype, T, offset):
    # the module rotates with roll and a sign-folded sine (fewer operations per decoding step);
    # it must give exactly apply_rope's x * cos + rotate_half(x) * sin
    rope = RotaryEmbedding(8)
    q, k = torch.randn(2, 4, T, 8).to(dtype) * 5, torch.randn(2, 2, T, 8).to(dtype)
    cos, sin = rope.cos_sin(T, offset, dtype=dtype)
    q_rot, k_rot = rope(q, k, offset)
    assert torch.equal(q_rot, apply_rope(q, cos, sin)), f"queries differ from apply_rope at T={T}, offset={offset}"
    assert torch.equal(k_rot, apply_rope(k, cos, sin)), f"keys differ from apply_rope at T={T}, offset={offset}"


def test_rope_is_a_rotation_that_leaves_position_zero_alone_and_keeps_norms():
    rope = RotaryEmbedding(16)
    x = torch.randn(1, 1, 9, 16)
    rotated, _ = rope(x, x)
    torch.testing.assert_close(rotated[..., 0, :], x[..., 0, :])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(rotated[..., 1:, :], x[..., 1:, :])


def test_rope_offset_for_cached_decoding_matches_rotating_the_whole_sequence():
    rope = RotaryEmbedding(8)
    x = torch.randn(1, 2, 7, 8)
    full, _ = rope(x, x)
    step, _ = rope(x[..., 4:5, :], x[..., 4:5, :], offset=4)
    torch.testing.assert_close(step, full[..., 4:5, :])


def rope_score(q, k, m, n, head_dim):
    rope = RotaryEmbedding(head_dim)
    cos_m, sin_m = rope.cos_sin(1, m)
    cos_n, sin_n = rope.cos_sin(1, n)
    return (apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum()


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 300), n=st.integers(0, 300), shift=st.integers(0, 300),
       half=st.sampled_from([1, 2, 4, 16]), seed=st.integers(0, 2**16))
def test_rope_score_depends_only_on_the_distance_m_minus_n(m, n, shift, half, seed):
    head_dim = 2 * half
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, head_dim, generator=g), torch.randn(1, head_dim, generator=g)
    here = rope_score(q, k, m, n, head_dim)
    shifted = rope_score(q, k, m + shift, n + shift, head_dim)
    assert abs(here - shifted) <= 1e-3 * (1 + q.norm() * k.norm())


def test_rope_score_does_change_with_the_distance():
    q, k = torch.randn(1, 16), torch.randn(1, 16)
    assert abs(rope_score(q, k, 5, 2, 16) - rope_score(q, k, 5, 4, 16)) > 1e-3


def test_rope_rejects_mismatched_inputs():
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="head_dim=8"):
        rope(torch.randn(1, 1, 3, 6), torch.randn(1, 1, 3, 6))
    with pytest.raises(ValueError, match="3 queries and 2 keys"):
        rope(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 2, 8))
    with pytest.raises(ValueError, match="even head_dim"):
        RotaryEmbedding(7)


# ---- ALiBi ------------------------------------------------------------------------------------

def test_alibi_slopes_for_eight_heads_are_powers_of_one_half():
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]


def test_alibi_slopes_for_a_non_power_of_two_follow_the_published_rule():
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
    expected = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -(i + 0.5) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                                              2.0 ** -1, 2.0 ** -3]))


@pytest.mark.parametrize("n_heads", list(range(1, 34)))
def test_alibi_slopes_match_bloom(n_heads):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    # BLOOM adds slope * key_position; at key position 1 that is the slope itself
    bias = bloom.build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float32)  # (h, 1, 2)
    torch.testing.assert_close(alibi_slopes(n_heads), bias[:, 0, 1])


def test_alibi_bias_is_minus_slope_times_distance():
    bias = alibi_bias(2, 3)                                   # slopes 2^-4, 2^-8
    distance = torch.tensor([[0.0, 1, 2], [1, 0, 1], [2, 1, 0]])
    torch.testing.assert_close(bias, -torch.stack([distance / 16, distance / 256]))
    # with cached keys the queries are the last T positions
    torch.testing.assert_close(alibi_bias(8, 2, 5), alibi_bias(8, 5)[:, -2:])


def test_alibi_with_a_causal_mask_matches_bloom_scores_after_softmax():
    # BLOOM adds slope * j instead of -slope * (i - j); per query row they differ by the
    # constant slope * i, which the softmax cancels.
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    h, T = 4, 6
    scores = torch.randn(h, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ours = (scores + alibi_bias(h, T)).masked_fill(~causal, float("-inf")).softmax(-1)
    theirs_bias = bloom.build_alibi_tensor(torch.ones(1, T), h, torch.float32)  # (h, 1, T)
    theirs = (scores + theirs_bias).masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("bad, message", [
    (lambda: alibi_slopes(0), "n_heads"), (lambda: alibi_slopes(2.0), "n_heads"),
    (lambda: alibi_bias(4, 5, 3), "T <= S"), (lambda: alibi_bias(4, 0), "T"),
])
def test_alibi_rejects_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


# ---- the graded exercises of notebook 03 agree with the library ------------------------------

def test_exercise_references_of_notebook_03_agree_with_the_library():
    from tutorial_lib.exercises import reference

    torch.testing.assert_close(reference("03.sinusoidal_table")(12, 8), sinusoidal_table(12, 8))
    x = torch.randn(2, 3, 6, 8)
    torch.testing.assert_close(reference("03.apply_rope")(x, 500.0), RotaryEmbedding(8, 500.0)(x, x)[0])
    for n in (1, 5, 8, 12, 20):
        torch.testing.assert_close(reference("03.alibi_slopes")(n), alibi_slopes(n))
    torch.testing.assert_close(reference("03.alibi_bias")(alibi_slopes(6), 5), alibi_bias(6, 5))


def test_rotary_rows_follow_the_module_to_another_device():
    # the rows of the last call are remembered for the next layer's call; moving the module
    # must forget them, or a moved model would rotate with the old device's rows
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 2, 3, 8)
    rope(q, q, 5)
    rope.to("meta")
    q_rot, _ = rope(q.to("meta"), q.to("meta"), 5)
    cos, _ = rope.cos_sin(3, 5)
    assert q_rot.device.type == "meta" and cos.device.type == "meta", \
        f"after .to('meta') the rotation ran on {q_rot.device} with rows on {cos.device}"
