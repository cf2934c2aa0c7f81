"""Exercises of notebook 01 (attention)."""

from __future__ import annotations

import math

import torch

from .core import Exercise, Mistake


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 01.attention: scaled dot-product attention with a mask -----------------------------

def attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d_k)) v over the last two dimensions; mask True = may attend."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


def _attention_cases():
    """3-D inputs with a (T, S) mask, and 4-D (B, h, T, d_k) inputs with the masks of the course:
    a key-padding mask (B, 1, 1, S) and a per-example (B, 1, T, S) mask, both broadcast over the
    heads. S == d_k everywhere, so that the named mistake "K not transposed" runs and is
    recognised; one 4-D case has h == S == d_k, where transposing the wrong axes
    (k.transpose(1, 2)) runs and gives wrong numbers instead of an error."""
    g = _gen(1)

    def keys_kept(*shape):  # every query keeps at least one key and blocks at least one
        mask = torch.rand(*shape, generator=g) > 0.4
        mask[..., 0], mask[..., -1] = True, False
        return mask

    cases = []
    for batch, T, S, d_v in ((2, 3, 4, 5), (1, 5, 16, 3)):  # (B, T, d_k) with d_k = S
        q, k = (torch.randn(batch, n, S, generator=g) * 2 for n in (T, S))
        v = torch.randn(batch, S, d_v, generator=g)
        cases += [(q, k, v, None), (q, k, v, keys_kept(T, S))]
    for batch, heads, T, S, d_v in ((2, 3, 5, 6, 7), (2, 4, 3, 4, 2)):  # (B, h, T, d_k), d_k = S
        q = torch.randn(batch, heads, T, S, generator=g) * 2
        k = torch.randn(batch, heads, S, S, generator=g) * 2
        v = torch.randn(batch, heads, S, d_v, generator=g)
        cases += [(q, k, v, keys_kept(batch, 1, 1, S)), (q, k, v, keys_kept(batch, 1, T, S))]
    return cases


def _no_scale(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def _scale_by_d(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / q.size(-1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def _softmax_wrong_axis(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-2) @ v


def _mask_inverted(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


def _k_not_transposed(q, k, v, mask=None):
    scores = q @ k / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def _mask_after_softmax(q, k, v, mask=None):
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(-1)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)
    return weights @ v


# ---- 01.split_heads and 01.merge_heads ----------------------------------------------------

def split_heads(x, n_heads):
    """(B, T, d) -> (B, h, T, d/h): head i gets the contiguous features i*d_k .. (i+1)*d_k - 1."""
    B, T, d = x.shape
    return x.view(B, T, n_heads, d // n_heads).transpose(1, 2)


def _split_cases():
    g = _gen(2)
    return [(torch.randn(2, 3, 8, generator=g), 2), (torch.randn(1, 5, 12, generator=g), 3)]


def _split_reshape_only(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, n_heads, T, d // n_heads)


def _split_no_transpose(x, n_heads):
    B, T, d = x.shape
    return x.view(B, T, n_heads, d // n_heads)


def _split_interleaved(x, n_heads):
    B, T, d = x.shape
    return x.view(B, T, d // n_heads, n_heads).permute(0, 3, 1, 2)


def merge_heads(x):
    """(B, h, T, d_k) -> (B, T, h * d_k), the inverse of split_heads."""
    B, h, T, d_k = x.shape
    return x.transpose(1, 2).reshape(B, T, h * d_k)


def _merge_cases():
    g = _gen(3)
    return [(torch.randn(2, 2, 3, 4, generator=g),), (torch.randn(1, 3, 5, 2, generator=g),)]


def _merge_reshape_only(x):
    B, h, T, d_k = x.shape
    return x.reshape(B, T, h * d_k)


def _merge_sum_heads(x):
    return x.sum(dim=1)


def _merge_interleaved(x):
    B, h, T, d_k = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, T, d_k * h)


# ---- 01.mha_parameters ----------------------------------------------------------------------

def mha_parameters(d_model, n_heads, bias):
    """Parameters of multi-head attention: W_Q, W_K, W_V and W_O, each d x d, plus biases."""
    return 4 * d_model * d_model + (4 * d_model if bias else 0)


def _params_cases():
    return [(64, 4, True), (64, 8, True), (512, 8, False), (768, 12, True)]


def _params_per_head(d_model, n_heads, bias):
    return n_heads * mha_parameters(d_model, n_heads, bias)


def _params_no_output(d_model, n_heads, bias):
    return 3 * d_model * d_model + (3 * d_model if bias else 0)


def _params_no_bias(d_model, n_heads, bias):
    return 4 * d_model * d_model


EXERCISES = [
    Exercise(
        name="01.attention",
        task="attention(q, k, v, mask=None): softmax(q k^T / sqrt(d_k)) v over the last two "
             "dimensions of q (..., T, d_k), k (..., S, d_k) and v (..., S, d_v); mask is boolean, "
             "True = may attend, and broadcasts to (..., T, S), e.g. (B, 1, 1, S) or (B, 1, T, S) "
             "for inputs (B, h, T, d_k). Written out, without PyTorch's or the library's attention.",
        cases=_attention_cases,
        reference=attention,
        mistakes={
            "missing 1/sqrt(d_k)": Mistake(_no_scale, "Scale the scores by 1/sqrt(d_k) before the "
                                           "softmax; without it large d_k saturates the softmax."),
            "divided by d_k instead of sqrt(d_k)": Mistake(
                _scale_by_d, "The dot product of two random d_k-vectors has variance d_k, so its "
                             "standard deviation is sqrt(d_k): divide by math.sqrt(d_k)."),
            "softmax over the wrong axis": Mistake(
                _softmax_wrong_axis, "Each query's weights must sum to 1 over the keys: softmax "
                                     "over the last dimension (dim=-1), not over the queries."),
            "mask inverted": Mistake(
                _mask_inverted, "True means *may attend*: fill the scores with -inf where the mask "
                                "is False (masked_fill(~mask, ...))."),
            "K not transposed": Mistake(
                _k_not_transposed, "Scores are q @ k.transpose(-2, -1): each query is dotted with "
                                   "each key. q @ k only ran because S happened to equal d_k."),
            "mask applied after the softmax": Mistake(
                _mask_after_softmax, "Zeroing weights after the softmax leaves rows that no longer "
                                     "sum to 1. Put -inf into the scores before the softmax."),
        },
        # PyTorch's and the library's attention would hand in the answer
        forbidden=("scaled_dot_product_attention", "fused_attention", "MultiheadAttention", "MultiHeadAttention",
                   "multi_head_attention_forward", "_scaled_dot_product_attention_math"),
    ),
    Exercise(
        name="01.split_heads",
        task="split_heads(x, n_heads): (B, T, d) -> (B, h, T, d/h), head i taking the contiguous "
             "block of features i*d_k .. (i+1)*d_k - 1.",
        cases=_split_cases,
        reference=split_heads,
        mistakes={
            "reshaped straight to (B, h, T, d_k)": Mistake(
                _split_reshape_only, "A reshape keeps the memory order, so head 0 would get the "
                "first tokens' features. View as (B, T, h, d_k) first, then swap T and h."),
            "forgot the transpose": Mistake(
                _split_no_transpose, "After .view(B, T, h, d_k) swap dimensions 1 and 2 so the "
                                     "heads come before the positions."),
            "heads take interleaved features": Mistake(
                _split_interleaved, "Head i owns a contiguous block of d_k features, not every "
                                    "h-th feature: view as (B, T, h, d_k), not (B, T, d_k, h)."),
        },
    ),
    Exercise(
        name="01.merge_heads",
        task="merge_heads(x): (B, h, T, d_k) -> (B, T, h*d_k), the inverse of split_heads.",
        cases=_merge_cases,
        reference=merge_heads,
        mistakes={
            "reshape without transposing back": Mistake(
                _merge_reshape_only, "Swap h and T back first (x.transpose(1, 2)), then reshape; "
                                     "a bare reshape mixes positions into features."),
            "summed the heads": Mistake(
                _merge_sum_heads, "The heads are concatenated, not added: the output projection "
                                  "W_O is what mixes them."),
            "features of the heads interleaved": Mistake(
                _merge_interleaved, "Head i's d_k features must come out as one contiguous block "
                                    "(features i*d_k .. (i+1)*d_k - 1): move h next to d_k with "
                                    "transpose(1, 2), keeping h before d_k."),
        },
    ),
    Exercise(
        name="01.mha_parameters",
        task="mha_parameters(d_model, n_heads, bias): the number of parameters of multi-head "
             "self-attention with d_k = d_model / n_heads.",
        cases=_params_cases,
        reference=mha_parameters,
        mistakes={
            "counted the full projections once per head": Mistake(
                _params_per_head, "Splitting into heads does not add parameters: each head uses "
                                  "a d_model x d_k slice of the same W_Q, W_K, W_V."),
            "forgot the output projection W_O": Mistake(
                _params_no_output, "After the heads are concatenated, W_O (d x d, plus bias) "
                                   "mixes them."),
            "forgot the biases": Mistake(
                _params_no_bias, "With bias=True each of the four projections has a bias of "
                                 "d_model entries."),
        },
        # counting a built layer is how to check the formula, not the formula
        forbidden=("MultiHeadAttention", "MultiheadAttention", "numel", "expected_parameters", "block_parameters"),
    ),
]
