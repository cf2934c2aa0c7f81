"""Notebook 09's checkers reject plausible wrong answers that they do not name."""

import torch

from tutorial_lib import bpe
from tutorial_lib.exercises import check
from tutorial_lib.exercises.core import ERROR, PASSED, WRONG


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


def merge_pair_exercise(ids, pair, new_id):  # the notebook's name for the learner's function
    return bpe.merge_pair(ids, pair, new_id)  # hands in the library's answer


def test_merge_pair_loopholes_are_closed():
    delegated = check("09.merge_pair", merge_pair_exercise)
    assert delegated.status == WRONG and "merge_pair" in delegated.message, str(delegated)

    def merge_as_text(ids, pair, new_id):  # replaces "a b" in the ids written out: right for one-digit ids only
        text = " ".join(map(str, ids)).replace(f"{pair[0]} {pair[1]}", str(new_id))
        return [int(t) for t in text.split()]

    assert check("09.merge_pair", merge_as_text).status == WRONG

    def merge_in_place(ids, pair, new_id):  # the right tokens, but written into the caller's list
        i = 0
        while i < len(ids) - 1:
            if (ids[i], ids[i + 1]) == tuple(pair):
                ids[i:i + 2] = [new_id]
            i += 1
        return ids

    changed = check("09.merge_pair", merge_in_place)
    assert changed.status == ERROR and "changed the list ids" in changed.message, str(changed)

    def merge_on_a_copy(ids, pair, new_id):  # the same loop on a copy is a right answer
        return merge_in_place(list(ids), pair, new_id)

    assert check("09.merge_pair", merge_on_a_copy).status == PASSED
