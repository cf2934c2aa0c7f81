"""The checkers of notebooks 01-03 reject plausible wrong answers that they do not name, and
answers that hand in the library's (or PyTorch's) version instead of writing it.

That every reference passes and every named mistake is named is tested for all checkers in
test_exercises.py; this file adds the answers a checker must reject without naming them.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib.exercises import EXERCISES, check
from tutorial_lib.exercises.core import ERROR, MISTAKE, PASSED, WRONG, _run, same
from tutorial_lib.masks import causal_mask, combine, padding_mask
from tutorial_lib.positions import alibi_bias, alibi_slopes, sinusoidal_table

# ---- 01.attention --------------------------------------------------------------------------------


def attention_bmm(q, k, v, mask=None):
    """Right for 3-D inputs only: torch.bmm takes (batch, n, m) and nothing else."""
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.bmm(scores.softmax(dim=-1), v)


def attention_transpose_1_2(q, k, v, mask=None):
    """k.transpose(1, 2) is K^T for (B, S, d_k), but swaps heads and positions for (B, h, S, d_k)."""
    scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


def attention_softmax_dim_2(q, k, v, mask=None):
    """dim=2 is the key axis of (B, T, S) scores, but the query axis of (B, h, T, S)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=2) @ v


def attention_sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_attention_cases_hold_4d_inputs_with_both_broadcast_masks_and_one_where_h_s_and_dk_coincide():
    cases = EXERCISES["01.attention"].cases()
    four_d = [case for case in cases if case[0].dim() == 4]
    assert any(m.shape[1:3] == (1, 1) for *_, m in four_d), "a (B, 1, 1, S) key-padding mask"
    assert any(m.shape[1] == 1 and m.shape[2] == q.size(2) > 1 for q, *_, m in four_d), "a (B, 1, T, S) mask"
    assert any(q.size(1) == k.size(2) == q.size(3) for q, k, *_ in four_d), "a case with h == S == d_k"


@pytest.mark.parametrize("answer, status, raised", [(attention_bmm, ERROR, "RuntimeError"),
                                                    (attention_transpose_1_2, ERROR, "RuntimeError"),
                                                    (attention_softmax_dim_2, WRONG, None)],
                         ids=["bmm", "transpose(1, 2)", "softmax dim 2"])
def test_attention_answers_that_only_work_on_3d_inputs_are_rejected(answer, status, raised):
    result = check("01.attention", answer)
    assert result.status == status, str(result)
    assert raised is None or raised in result.message, str(result)
    # each of them is right on the 3-D cases: only the 4-D cases catch it
    cases = EXERCISES["01.attention"].cases()
    ref = EXERCISES["01.attention"].reference
    assert all(same(_run(answer, c), _run(ref, c)) for c in cases if c[0].dim() == 3)


def test_the_transpose_answer_gives_wrong_numbers_without_an_error_where_h_s_and_dk_coincide():
    ref = EXERCISES["01.attention"].reference
    square = [c for c in EXERCISES["01.attention"].cases() if c[0].dim() == 4 and c[0].size(1) == c[1].size(2)]
    assert square and all(not same(_run(attention_transpose_1_2, c), _run(ref, c)) for c in square)


def test_a_one_line_sdpa_answer_is_refused_and_the_function_named():
    result = check("01.attention", attention_sdpa)
    assert result.status == WRONG and "scaled_dot_product_attention" in result.message, str(result)
    library = check("01.attention", lambda q, k, v, mask=None: __import__("tutorial_lib.attention").attention
                    .scaled_dot_product_attention(q, k, v, mask).out)
    assert library.status == WRONG and "scaled_dot_product_attention" in library.message, str(library)


# ---- 01.split_heads, 01.merge_heads, 01.mha_parameters ---------------------------------------------


def split_transpose_then_reshape(x, n_heads):
    B, T, d = x.shape
    return x.transpose(1, 2).reshape(B, n_heads, T, d // n_heads)


def merge_cat_over_positions(x):
    return torch.cat(x.unbind(dim=1), dim=1)  # (B, h*T, d_k): heads stacked along the positions


def mha_one_head_only(d_model, n_heads, bias):
    d_k = d_model // n_heads
    return 4 * d_model * d_k + (4 * d_k if bias else 0)


def mha_counted_from_the_layer(d_model, n_heads, bias):
    from tutorial_lib.attention import MultiHeadAttention

    return sum(p.numel() for p in MultiHeadAttention(d_model, n_heads, bias=bias).parameters())


@pytest.mark.parametrize("name, answer", [("01.split_heads", split_transpose_then_reshape),
                                          ("01.merge_heads", merge_cat_over_positions),
                                          ("01.mha_parameters", mha_one_head_only)],
                         ids=["split: transpose then reshape", "merge: cat over positions", "params: one head"])
def test_unnamed_wrong_answers_of_the_other_01_checkers_are_rejected(name, answer):
    result = check(name, answer)
    assert result.status == WRONG, str(result)


def test_counting_a_built_layer_is_not_the_formula():
    result = check("01.mha_parameters", mha_counted_from_the_layer)
    assert result.status == WRONG and "MultiHeadAttention" in result.message, str(result)


# ---- 02 -----------------------------------------------------------------------------------------


def decoder_mask_padding_off_by_one(lengths, T):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return ((j <= i)[None] & (j <= lengths[:, None])[:, None, :]).unsqueeze(1)


def decoder_mask_from_the_library(lengths, T):
    return combine(causal_mask(T), padding_mask(lengths, T))


def decoder_mask_with_a_local_named_like_the_library(lengths, T):
    causal_mask = torch.ones(T, T, dtype=torch.bool).tril()  # a variable, not the library function
    real_key = torch.arange(T)[None, :] < lengths[:, None]
    return (causal_mask[None] & real_key[:, None, :]).unsqueeze(1)


def cached_mask_all_at_the_newest_position(query_positions, S):
    return (torch.arange(S)[None, :] <= query_positions[-1]).expand(len(query_positions), S).clone()


def softmax_by_boolean_indexing(scores, mask):
    """Right when the mask has the scores' shape; a broadcast (B, 1, 1, S) mask cannot index."""
    filled = scores.clone()
    filled[~mask] = float("-inf")
    weights = filled.softmax(dim=-1)
    weights[torch.isnan(weights)] = 0.0
    return weights


def teacher_forcing_bos_at_the_end(tokens, bos, eos):
    B = tokens.size(0)
    column = torch.full((B, 1), bos, dtype=tokens.dtype)
    return torch.cat((column, tokens), 1), torch.cat((tokens, column), 1)


@pytest.mark.parametrize("name, answer", [
    ("02.decoder_self_mask", decoder_mask_padding_off_by_one),
    ("02.cached_causal_mask", cached_mask_all_at_the_newest_position),
    ("02.masked_softmax", softmax_by_boolean_indexing),
    ("02.teacher_forcing", teacher_forcing_bos_at_the_end),
], ids=["decoder mask: j <= length", "cached: every query at the newest position",
        "softmax: boolean indexing", "teacher forcing: BOS as the last target"])
def test_unnamed_wrong_answers_of_the_02_checkers_are_rejected(name, answer):
    result = check(name, answer)
    if answer is softmax_by_boolean_indexing:  # a broadcast mask cannot index the scores: torch raises
        assert result.status == ERROR and "IndexError" in result.message, str(result)
    else:
        assert result.status == WRONG, str(result)


def test_the_decoder_mask_from_the_library_is_refused_but_a_variable_of_that_name_is_not():
    refused = check("02.decoder_self_mask", decoder_mask_from_the_library)
    assert refused.status == WRONG and "causal_mask" in refused.message, str(refused)
    assert check("02.decoder_self_mask", decoder_mask_with_a_local_named_like_the_library).status == PASSED


def test_teacher_forcing_with_float_ids_is_named_and_the_dtype_reported():
    result = check("02.teacher_forcing", EXERCISES["02.teacher_forcing"].mistakes["ids turned into floats"].fn)
    assert result.status == MISTAKE, str(result)

    def floats_somewhere_else(tokens, bos, eos):  # not the named mistake: the tokens cast themselves
        inputs, targets = EXERCISES["02.teacher_forcing"].reference(tokens, bos, eos)
        return inputs.float(), targets

    other = check("02.teacher_forcing", floats_somewhere_else)
    assert other.status == WRONG and "dtype" in other.message, str(other)


# ---- 03 -----------------------------------------------------------------------------------------


def sinusoidal_multiplied(T, d):
    p = torch.arange(T, dtype=torch.float64)[:, None]
    angle = p * 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # times, not divided by
    return torch.stack((angle.sin(), angle.cos()), dim=-1).reshape(T, d).float()


def rope_base_ignored(x, base=10000.0):
    return EXERCISES["03.apply_rope"].reference(x, 10000.0)


def slopes_reversed(n_heads):
    return EXERCISES["03.alibi_slopes"].reference(n_heads).flip(0)


def bias_from_the_default_slopes(slopes, T):
    return EXERCISES["03.alibi_bias"].reference(alibi_slopes(len(slopes)), T)


@pytest.mark.parametrize("name, answer", [
    ("03.sinusoidal_table", sinusoidal_multiplied),
    ("03.apply_rope", rope_base_ignored),
    ("03.alibi_slopes", slopes_reversed),
    ("03.alibi_bias", bias_from_the_default_slopes),
], ids=["table: p times 10000^(2i/d)", "rope: base ignored", "slopes reversed", "bias: slopes recomputed"])
def test_unnamed_wrong_answers_of_the_03_checkers_are_rejected(name, answer):
    result = check(name, answer)
    assert result.status == WRONG, str(result)


def library_table(T, d):
    return sinusoidal_table(T, d)


def library_bias(slopes, T):
    return alibi_bias(len(slopes), T)


@pytest.mark.parametrize("name, answer, used", [("03.sinusoidal_table", library_table, "sinusoidal_table"),
                                                ("03.alibi_bias", library_bias, "alibi_bias")])
def test_03_answers_that_call_the_library_are_refused(name, answer, used):
    result = check(name, answer)
    assert result.status == WRONG and used in result.message, str(result)
