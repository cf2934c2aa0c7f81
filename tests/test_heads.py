"""Head scores on attention patterns whose answer is known."""

import pytest
import torch

from tutorial_lib import heads


def shifted_pattern(T, offset, start):
    """Weights (T, T) that put everything on key t - offset from position start on, and on key 0 before."""
    w = torch.zeros(T, T)
    w[:start, 0] = 1.0
    rows = torch.arange(start, T)
    w[rows, rows - offset] = 1.0
    return w


def test_a_pure_previous_token_pattern_scores_one_and_an_induction_pattern_scores_one():
    period, T = 5, 10
    previous = shifted_pattern(T, 1, 1)
    induction = shifted_pattern(T, period - 1, period)
    both = torch.stack([previous, induction])  # (2 heads, T, T)
    # the induction pattern's only weight on t - 1 is position 1's weight on key 0: 1 of 9 positions
    assert torch.allclose(heads.previous_token_scores(both), torch.tensor([1.0, 1 / 9]))
    assert heads.induction_scores(both, period).tolist() == [0.0, 1.0]


def test_uniform_causal_attention_scores_the_mean_of_one_over_the_row_length():
    T, period = 8, 4
    uniform = torch.ones(T, T).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)  # row t: 1 / (t + 1) on each key
    expected_prev = sum(1 / (t + 1) for t in range(1, T)) / (T - 1)
    expected_induction = sum(1 / (t + 1) for t in range(period, T)) / (T - period)
    assert abs(heads.previous_token_scores(uniform).item() - expected_prev) < 1e-6
    assert abs(heads.induction_scores(uniform, period).item() - expected_induction) < 1e-6


def test_repeated_random_tokens_repeat_and_differ_between_rows():
    ids = heads.repeated_random_tokens(50, 7, repeats=3, batch=4, low=10, generator=torch.Generator().manual_seed(0))
    assert ids.shape == (4, 21)
    assert torch.equal(ids[:, :7], ids[:, 7:14]) and torch.equal(ids[:, :7], ids[:, 14:])
    assert ids.min() >= 10 and ids.max() < 50
    assert not torch.equal(ids[0], ids[1])
    assert all(len(set(row[:7].tolist())) == 7 for row in ids), "no id repeats inside one copy"
    tight = heads.repeated_random_tokens(12, 10, batch=3, low=2, generator=torch.Generator().manual_seed(1))
    assert all(sorted(row[:10].tolist()) == list(range(2, 12)) for row in tight), "all 10 allowed ids, once each"


def test_bad_shapes_and_periods_are_value_errors():
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\)"):
        heads.previous_token_scores(torch.ones(3, 4))
    with pytest.raises(ValueError, match="period"):
        heads.induction_scores(torch.ones(4, 4), 4)
    with pytest.raises(ValueError, match="period"):
        heads.repeated_random_tokens(10, 0)
    with pytest.raises(ValueError, match=r"period must be at most the 5 ids .*got 6"):
        heads.repeated_random_tokens(10, 6, low=5)
