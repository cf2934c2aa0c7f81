"""Exercises of notebook 09 (real models): one BPE merge step, GPT-2's fused Conv1D attention
weights into nn.Linear layout, and scoring heads for induction."""

from __future__ import annotations

import copy

import torch

from ..bpe import merge_pair  # the reference solution
from ..heads import induction_scores  # the reference solution
from .core import Exercise, Mistake

# ---- 09.merge_pair: one BPE merge applied to a sequence of ids ---------------------------------


class _InputList(list):
    """The ``ids`` a case hands to the learner's function: a list that refuses to be changed,
    so that changing ``ids`` in place instead of returning a new list is reported by name."""

    def __deepcopy__(self, memo):  # the grader copies every case; list's own copy would append
        return _InputList(copy.deepcopy(list(self), memo))


def _refuse(method: str):
    def refuse(self, *args, **kwargs):
        raise ValueError(f"your function changed the list ids it was given (list.{method}); build a new list, "
                         "return it, and leave ids as it was")
    return refuse


for _method in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
                "remove", "clear", "sort", "reverse"):
    setattr(_InputList, _method, _refuse(_method))


def _merge_cases():
    cases = [([1, 2, 1, 2, 3], (1, 2), 9), ([5, 5, 5], (5, 5), 7), ([5, 5, 5, 5], (5, 5), 7),
             ([3, 1, 2, 1, 1, 2], (1, 2), 8), ([1, 2], (2, 1), 9), ([4], (4, 4), 6), ([], (1, 2), 9),
             ([2, 1, 2, 2, 1, 2, 1], (2, 1), 5),
             # ids of several digits, so that replacing "5 5" in the ids written as text is wrong
             ([15, 5, 51, 256, 5, 5], (5, 5), 300), ([21, 5, 5, 12, 1, 5], (1, 5), 301)]
    return [(_InputList(ids), pair, new_id) for ids, pair, new_id in cases]


def _merge_first_only(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == tuple(pair):
            return ids[:i] + [new_id] + ids[i + 2:]
    return list(ids)


def _merge_right_to_left(ids, pair, new_id):
    out, i = [], len(ids) - 1
    while i >= 0:
        if i >= 1 and (ids[i - 1], ids[i]) == tuple(pair):
            out.append(new_id)
            i -= 2
        else:
            out.append(ids[i])
            i -= 1
    return out[::-1]


def _merge_step_one(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == tuple(pair):
            out.append(new_id)
        else:
            out.append(ids[i])
        i += 1  # moves on by one even after a merge, so the right token is seen again
    return out


# ---- 09.split_c_attn: GPT-2's fused Conv1D projection as three nn.Linear weights --------------


def split_c_attn(weight, bias):
    """GPT-2's c_attn is a Conv1D: weight (d, 3d) holds (in, out), so y = x @ weight + bias,
    with the output columns ordered [Q | K | V]. nn.Linear stores (out, in): transpose, then
    split the 3d output rows into three."""
    w_q, w_k, w_v = weight.t().chunk(3, dim=0)  # each (d, d): (out, in)
    b_q, b_k, b_v = bias.chunk(3)
    return w_q, w_k, w_v, b_q, b_k, b_v


def _c_attn_cases():
    g = torch.Generator().manual_seed(9)  # d divisible by 3, so that a wrong split can run too
    return [(torch.randn(d, 3 * d, generator=g), torch.randn(3 * d, generator=g)) for d in (3, 6, 9)]


def _c_attn_no_transpose(weight, bias):
    w_q, w_k, w_v = weight.chunk(3, dim=1)  # (in, out) blocks: Conv1D's layout, not nn.Linear's
    return (w_q, w_k, w_v, *bias.chunk(3))


def _c_attn_input_axis(weight, bias):
    w_q, w_k, w_v = (w.t() for w in weight.chunk(3, dim=0))  # cuts the input features instead
    return (w_q, w_k, w_v, *bias.chunk(3))


def _c_attn_interleaved(weight, bias):
    w = weight.t()  # right layout, but takes every third row as if Q, K, V alternated
    return (w[0::3], w[1::3], w[2::3], bias[0::3], bias[1::3], bias[2::3])


# ---- 09.induction_scores -------------------------------------------------------------------------------


def _induction_cases():
    g = torch.Generator().manual_seed(19)
    cases = []
    for h, period, repeats in ((3, 4, 2), (2, 5, 3), (4, 6, 2)):
        T = period * repeats
        scores = torch.randn(h, T, T, generator=g) * 2
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        cases.append((scores.masked_fill(~causal, float("-inf")).softmax(dim=-1), period))
    batched = torch.rand(2, 3, 8, 8, generator=g).tril()
    cases.append((batched / batched.sum(-1, keepdim=True), 4))
    return cases


def _induction_same_token(weights, period):
    T = weights.size(-1)
    rows = torch.arange(period, T)
    return weights[..., rows, rows - period].mean(dim=-1)


def _induction_previous_token(weights, period):
    T = weights.size(-1)
    rows = torch.arange(1, T)
    return weights[..., rows, rows - 1].mean(dim=-1)


def _induction_from_first_copy(weights, period):
    T = weights.size(-1)
    rows = torch.arange(period - 1, T)
    return weights[..., rows, rows - period + 1].mean(dim=-1)


EXERCISES = [
    Exercise(
        name="09.merge_pair",
        task="merge_pair(ids, pair, new_id): replace every occurrence of the adjacent pair in the list ids "
             "by new_id, scanning left to right without overlaps ([5, 5, 5] with pair (5, 5) gives "
             "[new_id, 5]); return a new list and leave ids unchanged.",
        cases=_merge_cases,
        reference=merge_pair,
        forbidden=("merge_pair",),
        mistakes={
            "merged only the first occurrence": Mistake(
                _merge_first_only, "BPE applies a merge everywhere in the piece, not once: keep scanning "
                                   "after the first match."),
            "scanned right to left": Mistake(
                _merge_right_to_left, "Overlapping occurrences are resolved from the left: in [5, 5, 5] the "
                                      "first two 5s merge, not the last two."),
            "moved on by one token after a merge": Mistake(
                _merge_step_one, "After a merge both tokens of the pair are used up: skip two positions, or "
                                 "the right token is copied again."),
        },
    ),
    Exercise(
        name="09.split_c_attn",
        task="split_c_attn(weight, bias): GPT-2's fused c_attn Conv1D has weight (d, 3d) stored as (in, out) "
             "and bias (3d,), outputs ordered [Q | K | V]. Return (w_q, w_k, w_v, b_q, b_k, b_v) with each "
             "weight in nn.Linear's (out, in) layout, (d, d), and each bias (d,).",
        cases=_c_attn_cases,
        reference=split_c_attn,
        forbidden=("hf_tensor_map", "load_hf_state_dict", "from_hf_model", "gpt2_from_hf"),
        mistakes={
            "forgot the transpose": Mistake(
                _c_attn_no_transpose, "Conv1D stores (in, out) and computes x @ W; nn.Linear stores (out, in) "
                                      "and computes x @ W.T. The shapes agree for square blocks, the numbers "
                                      "do not: transpose."),
            "split the input features": Mistake(
                _c_attn_input_axis, "Q, K and V are the three blocks of the *output* features: the 3d axis "
                                    "(columns of the Conv1D weight, rows after transposing)."),
            "took every third row": Mistake(
                _c_attn_interleaved, "The outputs are [all of Q | all of K | all of V], three contiguous "
                                     "blocks, not interleaved."),
        },
    ),
    Exercise(
        name="09.induction_scores",
        task="induction_scores(weights, period): weights (..., T, T) are self-attention weights on a random "
             "sequence repeated with the given period. Return (...,): for each head, the mean over query "
             "positions t >= period of the weight on key t - period + 1 (the token that followed the "
             "earlier occurrence of token t).",
        cases=_induction_cases,
        reference=induction_scores,
        forbidden=("induction_scores", "offset_scores"),
        mistakes={
            "scored the earlier occurrence itself": Mistake(
                _induction_same_token, "Key t - period holds the same token as t; an induction head looks one "
                                       "further, at t - period + 1, the token that came next last time."),
            "scored the previous token": Mistake(
                _induction_previous_token, "Attention to t - 1 marks a previous-token head, the induction "
                                           "head's helper; score key t - period + 1."),
            "started inside the first copy": Mistake(
                _induction_from_first_copy, "Position period - 1 is the last token of the first copy: it has "
                                            "no earlier occurrence. Start at t = period."),
        },
    ),
]
