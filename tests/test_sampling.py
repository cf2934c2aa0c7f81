"""Samplers: argument validation, the exact sets top-k and top-p keep (ties included),
reproducibility from a torch.Generator, and what temperature does to the distribution."""

import math

import pytest
import torch

from tutorial_lib.sampling import GREEDY, Sampler, top_k_filter, top_p_filter

NEG_INF = float("-inf")


def kept(filtered: torch.Tensor) -> list[int]:
    """Indices a filter left finite (a 1-D row)."""
    return torch.isfinite(filtered).nonzero().flatten().tolist()


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0, 0.0, -1.0, float("inf"), float("nan"), True, "1.0", None])
def test_temperature_must_be_a_positive_finite_number(temperature):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Sampler(temperature=temperature)


@pytest.mark.parametrize("k", [0, -3, 2.0, True, "5"])
def test_top_k_must_be_an_int_of_at_least_one(k):
    with pytest.raises(ValueError, match=r"top_k must be a positive int \(an int >= 1\)"):
        Sampler(top_k=k)
    with pytest.raises(ValueError, match="k >= 1"):
        top_k_filter(torch.zeros(5), k)


@pytest.mark.parametrize("p", [0.0, -0.1, 1.0000001, 2, float("nan"), True, "0.9"])
def test_top_p_must_lie_in_zero_one(p):
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        Sampler(top_p=p)
    with pytest.raises(ValueError, match="0 < p <= 1"):
        top_p_filter(torch.zeros(5), p)


def test_boundary_values_are_accepted():
    Sampler(temperature=1e-3, top_k=1, top_p=1.0)
    Sampler(temperature=100, top_p=1e-9)


# ---- top-k --------------------------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest_in_place():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    out = top_k_filter(logits, 2)
    assert kept(out) == [1, 3]
    assert torch.equal(out[[1, 3]], logits[[1, 3]]), "kept logits are not changed"
    assert (out[[0, 2, 4]] == NEG_INF).all()


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([3.0, 2.0, 1.0, 2.0, 0.0])
    assert kept(top_k_filter(logits, 2)) == [0, 1, 3]  # the 2nd largest value, 2.0, occurs twice
    assert kept(top_k_filter(logits, 3)) == [0, 1, 3]
    assert kept(top_k_filter(logits, 4)) == [0, 1, 2, 3]


def test_top_k_of_one_is_the_arg_max_and_k_past_the_vocabulary_keeps_everything():
    logits = torch.tensor([[0.1, 0.7, 0.2], [2.0, -1.0, 0.0]])
    out = top_k_filter(logits, 1)
    assert torch.isfinite(out).sum(-1).tolist() == [1, 1]
    assert torch.equal(out.argmax(-1), logits.argmax(-1))
    assert torch.equal(top_k_filter(logits, 3), logits)
    assert torch.equal(top_k_filter(logits, 50), logits)


# ---- top-p --------------------------------------------------------------------------------------

def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = logits_of([0.1, 0.5, 0.05, 0.3, 0.05])  # sorted: 0.5, 0.3, 0.1, 0.05, 0.05
    assert kept(top_p_filter(logits, 0.49)) == [1]  # 0.5 is enough on its own
    assert kept(top_p_filter(logits, 0.51)) == [1, 3]  # 0.5 + 0.3
    assert kept(top_p_filter(logits, 0.79)) == [1, 3]
    assert kept(top_p_filter(logits, 0.81)) == [0, 1, 3]  # 0.5 + 0.3 + 0.1
    assert kept(top_p_filter(logits, 0.95)) == [0, 1, 2, 3, 4]  # 0.9 < 0.95: both 0.05s (a tie)
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_top_p_always_keeps_the_most_likely_token():
    logits = logits_of([0.2, 0.25, 0.2, 0.15, 0.2])
    for p in (1e-9, 0.01, 0.25):
        assert kept(top_p_filter(logits, p)) == [1]


def test_top_p_keeps_ties_at_the_boundary_and_ignores_their_order():
    uniform = torch.zeros(4)
    assert kept(top_p_filter(uniform, 0.3)) == [0, 1, 2, 3], "equal tokens are kept or dropped together"
    logits = logits_of([0.4, 0.2, 0.2, 0.2])
    assert kept(top_p_filter(logits, 0.5)) == [0, 1, 2, 3]
    assert kept(top_p_filter(logits, 0.4)) == [0]
    # a function of the values: permuting the vocabulary permutes the answer
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 4, (64, 10), generator=g).float()  # many ties
    perm = torch.randperm(10, generator=g)
    for p in (0.2, 0.5, 0.9):
        assert torch.equal(top_p_filter(rows[:, perm], p), top_p_filter(rows, p)[:, perm])


def test_top_p_works_row_by_row_and_after_top_k():
    logits = torch.stack([logits_of([0.7, 0.2, 0.1]), logits_of([0.1, 0.2, 0.7])]).float()
    out = top_p_filter(logits, 0.85)
    assert torch.isfinite(out).tolist() == [[True, True, False], [False, True, True]]
    probs = Sampler(top_k=2, top_p=0.7).probabilities(logits_of([0.5, 0.3, 0.2])[None])
    # top-k leaves 0.5 and 0.3, renormalised to 0.625 and 0.375; 0.625 < 0.7, so both stay
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0]), atol=1e-6, rtol=0)


def test_filters_keep_the_input_dtype_and_never_change_kept_values():
    logits = torch.randn(3, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for out in (top_k_filter(logits, 5), top_p_filter(logits, 0.6)):
        assert out.dtype == torch.float64
        finite = torch.isfinite(out)
        assert torch.equal(out[finite], logits[finite])


# ---- the sampler ------------------------------------------------------------------------------

def test_sampling_is_reproducible_from_a_generator():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(temperature=1.3, top_k=10, top_p=0.9)

    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.stack([sampler(logits, g) for _ in range(25)])  # (25, B)

    assert torch.equal(draws(7), draws(7))
    assert not torch.equal(draws(7), draws(8))


def test_samples_follow_the_filtered_distribution_and_never_leave_it():
    logits = logits_of([0.4, 0.05, 0.3, 0.2, 0.05]).float().expand(20_000, 5)
    sampler = Sampler(top_k=3)  # keeps 0.4, 0.3, 0.2 -> 4/9, 3/9, 2/9
    ids = sampler(logits, torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0, 2, 3}
    freq = torch.bincount(ids, minlength=5).float() / len(ids)
    torch.testing.assert_close(freq, torch.tensor([4 / 9, 0, 3 / 9, 2 / 9, 0]), atol=0.015, rtol=0)


def test_greedy_takes_the_arg_max_and_its_probabilities_are_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.0, 4.5]])
    assert GREEDY(logits).tolist() == [1, 0]
    assert torch.equal(GREEDY.probabilities(logits), torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    # a top-k of 1 samples the same token whatever the generator
    g = torch.Generator().manual_seed(3)
    assert all(Sampler(top_k=1)(logits, g).tolist() == [1, 0] for _ in range(10))


def test_temperature_divides_the_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    for t in (0.5, 2.0):
        torch.testing.assert_close(Sampler(temperature=t).probabilities(logits), (logits / t).softmax(-1))


def test_higher_temperature_means_higher_entropy():
    logits = torch.tensor([3.0, 1.0, 0.5, 0.0, -2.0, 1.5])
    temps = [0.05, 0.25, 0.5, 1.0, 2.0, 4.0, 50.0]
    h = [entropy(Sampler(temperature=t).probabilities(logits[None])[0]) for t in temps]
    assert all(a < b for a, b in zip(h, h[1:])), f"entropy should grow with temperature: {h}"
    assert h[0] < 1e-6, "a very low temperature approaches the arg-max (entropy 0)"
    assert h[-1] > 0.99 * math.log(6), "a very high temperature approaches the uniform distribution"


def test_a_cpu_generator_draws_for_logits_on_another_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(top_k=5)
    on_gpu = sampler(logits.cuda(), torch.Generator().manual_seed(4))
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), sampler(logits, torch.Generator().manual_seed(4)))
