"""Notebook 09's checkers reject plausible wrong answers that they do not name."""

import torch

from tutorial_lib.exercises import check
from tutorial_lib.exercises.core import WRONG


def test_unnamed_wrong_answers_are_rejected():
    def merge_keeps_pair(ids, pair, new_id):  # appends the new id but keeps the pair's tokens
        out = []
        for i, t in enumerate(ids):
            out.append(t)
            if i + 1 < len(ids) and (t, ids[i + 1]) == tuple(pair):
                out.append(new_id)
        return out

    def split_swapped_k_v(weight, bias):
        w_q, w_k, w_v = weight.t().chunk(3, dim=0)
        b_q, b_k, b_v = bias.chunk(3)
        return w_q, w_v, w_k, b_q, b_v, b_k

    def induction_max(weights, period):
        rows = torch.arange(period, weights.size(-1))
        return weights[..., rows, rows - period + 1].max(dim=-1).values

    for name, fn in (("09.merge_pair", merge_keeps_pair), ("09.split_c_attn", split_swapped_k_v),
                     ("09.induction_scores", induction_max)):
        result = check(name, fn)
        assert result.status == WRONG, f"{name}: {result}"
