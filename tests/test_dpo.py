"""Direct Preference Optimization (tutorial_lib.dpo): the loss against a hand computation on a
tiny model (each answer token's probability from a softmax written as a loop over the
vocabulary, each prefix run on its own), ln 2 and a zero margin when the policy is its own
reference, the gradient (d loss / d margin = -beta sigmoid(-beta h), the parameter gradient
weighted by it, an SGD step that widens log p(chosen) - log p(rejected)), the date preference
pairs and their batches on the bundled SmolLM2 tokenizer, one DPO step with LoRA on the
bundled model, and bad inputs. The real model is loaded once for the module."""

import copy
import math
from datetime import date

import pytest
import torch

from tutorial_lib.config import ModelConfig
from tutorial_lib.dpo import (
    MISTAKES,
    collate_pairs,
    date_preference_pairs,
    dpo_batch_loss,
    dpo_loss,
    frozen_copy,
    preference_accuracy,
    sequence_log_probs,
    wrong_dates,
)
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.sft import IGNORE, ChatBatch, date_examples, date_messages

TINY = ModelConfig(family="decoder", vocab_size=7, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=8,
                   norm="rmsnorm", ffn="swiglu", positions="rope", bias=False, tie_embeddings=False)
X = IGNORE
# two pairs: prompt [1, 2] then chosen [3, 4] / rejected [5, 4]; prompt [6] then chosen [2, 1, 3] / rejected [2, 1, 5]
PAIRS = ChatBatch(ids=torch.tensor([[1, 2, 3, 4], [6, 2, 1, 3], [1, 2, 5, 4], [6, 2, 1, 5]]),
                  labels=torch.tensor([[X, X, 3, 4], [X, 2, 1, 3], [X, X, 5, 4], [X, 2, 1, 5]]))


def tiny(seed: int) -> DecoderOnlyLM:
    torch.manual_seed(seed)
    return DecoderOnlyLM(TINY).eval()


def log_prob_by_hand(model, ids: list[int], labels: list[int]) -> float:
    """Sum over counted tokens of log p(token | the tokens before it), each prefix run alone,
    the softmax written out in Python floats."""
    total = 0.0
    for t in range(1, len(ids)):
        if labels[t] == IGNORE:
            continue
        with torch.no_grad():
            z = model(torch.tensor([ids[:t]])).logits[0, -1].tolist()  # the logits after the prefix
        top = max(z)
        norm = sum(math.exp(v - top) for v in z)
        total += (z[ids[t]] - top) - math.log(norm)
    return total


def test_loss_equals_a_hand_computation_on_a_tiny_model():
    policy, reference, beta = tiny(0), tiny(1), 0.5
    rows = [(PAIRS.ids[i].tolist(), PAIRS.labels[i].tolist()) for i in range(4)]
    pol = [log_prob_by_hand(policy, *r) for r in rows]
    ref = [log_prob_by_hand(reference, *r) for r in rows]
    with torch.no_grad():
        torch.testing.assert_close(sequence_log_probs(policy, PAIRS), torch.tensor(pol), atol=1e-5, rtol=0)
    h = [(pol[i] - ref[i]) - (pol[2 + i] - ref[2 + i]) for i in range(2)]
    loss = sum(math.log1p(math.exp(-beta * m)) for m in h) / 2  # -log sigmoid(beta h), mean of two
    out = dpo_batch_loss(policy, reference, PAIRS, beta)
    torch.testing.assert_close(out.margins, torch.tensor(h), atol=1e-5, rtol=0)
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    assert abs(h[0]) > 0.01 and abs(h[1]) > 0.01  # the two models differ: a margin that tests something
    torch.testing.assert_close(out.chosen_rewards, beta * torch.tensor([pol[0] - ref[0], pol[1] - ref[1]]),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(out.chosen_rewards - out.rejected_rewards, beta * out.margins, atol=1e-6, rtol=0)


def test_policy_equal_to_its_reference_gives_a_zero_margin_and_ln_2():
    policy = tiny(0)
    reference = frozen_copy(policy)
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    out = dpo_batch_loss(policy, reference, PAIRS, beta=0.1)
    assert torch.equal(out.margins, torch.zeros(2))
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert preference_accuracy(out.margins) == 0.0  # h = 0 is no preference yet


def test_gradient_by_the_margin_is_minus_beta_sigmoid_and_weights_the_parameter_gradient():
    policy, reference, beta = tiny(0), frozen_copy(tiny(1)), 2.0
    pair = ChatBatch(PAIRS.ids[[0, 2]], PAIRS.labels[[0, 2]])  # one pair
    out = dpo_batch_loss(policy, reference, pair, beta)
    (by_margin,) = torch.autograd.grad(out.loss, out.margins, retain_graph=True)
    h = out.margins.detach()
    torch.testing.assert_close(by_margin, -beta * torch.sigmoid(-beta * h), atol=1e-7, rtol=1e-6)
    params = [p for p in policy.parameters()]
    by_params = torch.autograd.grad(out.loss, params, retain_graph=True)
    logp = sequence_log_probs(policy, pair)
    by_difference = torch.autograd.grad(logp[0] - logp[1], params)  # d (log p(y+) - log p(y-)) / d theta
    weight = (-beta * torch.sigmoid(-beta * h)).item()
    for g_loss, g_diff in zip(by_params, by_difference):
        torch.testing.assert_close(g_loss, weight * g_diff, atol=1e-6, rtol=1e-5)
    # on a batch the mean divides each pair's weight by B
    two = dpo_loss(*(torch.tensor([a, b], requires_grad=True) for a, b in ((-3.0, -5.0), (-4.0, -4.5),
                                                                         (-3.5, -4.0), (-4.0, -4.0))), beta=beta)
    (g,) = torch.autograd.grad(two.loss, two.margins)
    torch.testing.assert_close(g, -beta * torch.sigmoid(-beta * two.margins.detach()) / 2)


def test_an_sgd_step_widens_the_gap_between_chosen_and_rejected():
    policy = tiny(0)
    reference = frozen_copy(policy)
    with torch.no_grad():
        logp = sequence_log_probs(policy, PAIRS)
    gap_before = logp[:2] - logp[2:]
    out = dpo_batch_loss(policy, reference, PAIRS, beta=0.1)
    out.loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= 0.5 * p.grad
        logp = sequence_log_probs(policy, PAIRS)
    gap_after = logp[:2] - logp[2:]
    assert (gap_after > gap_before + 1e-4).all(), (gap_before, gap_after)
    after = dpo_batch_loss(policy, reference, PAIRS, beta=0.1)
    assert (after.margins > 0).all() and after.loss < math.log(2)
    assert preference_accuracy(after.margins) == 1.0


def test_bad_inputs():
    good = torch.tensor([-1.0, -2.0])
    for beta in (0, -0.1, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="beta must"):
            dpo_loss(good, good, good, good, beta=beta)
    with pytest.raises(ValueError, match=r"the same B pairs.*'policy_rejected': \(3,\)"):
        dpo_loss(good, torch.tensor([-1.0, -2.0, -3.0]), good, good)
    with pytest.raises(ValueError, match=r"reference_chosen must be float log-probabilities of shape \(B,\)"):
        dpo_loss(good, good, good[None], good)
    with pytest.raises(ValueError, match="policy_chosen must be float"):
        dpo_loss(torch.tensor([1, 2]), good, good, good)
    with pytest.raises(ValueError, match="2B rows .* got 3"):
        dpo_batch_loss(tiny(0), tiny(1), ChatBatch(PAIRS.ids[:3], PAIRS.labels[:3]))


# ---- the date pairs --------------------------------------------------------------------------------------------


def test_wrong_dates_are_plausible_and_stay_in_range():
    assert wrong_dates(date(1998, 3, 4)) == {"swap": "1998-04-03", "year": "1999-03-04", "day": "1998-03-05"}
    assert wrong_dates(date(2049, 12, 31)) == {"year": "2048-12-31", "day": "2049-12-30"}  # the range's end
    assert wrong_dates(date(2020, 2, 29)) == {"day": "2020-03-01"}  # no 29 February in 2019 or 2021
    assert "swap" not in wrong_dates(date(2001, 5, 5))  # swapping changes nothing


def test_preference_pairs_are_deterministic_and_right_against_wrong():
    pairs = date_preference_pairs(300, seed=2)
    assert pairs == date_preference_pairs(300, seed=2) and pairs != date_preference_pairs(300, seed=3)
    examples = date_examples(300, seed=2)
    assert [p.prompt for p in pairs] == [date_messages(e, answer=False) for e in examples]
    assert [p.chosen for p in pairs] == [e.target for e in examples]
    assert {p.mistake for p in pairs} == set(MISTAKES)
    for p, e in zip(pairs, examples):
        assert p.rejected != p.chosen and p.rejected == wrong_dates(e.date)[p.mistake]
        date.fromisoformat(p.rejected)  # a real date
    held = date_preference_pairs(50, split="held_out")
    assert not {p.prompt[0]["content"] for p in held} & {p.prompt[0]["content"] for p in pairs}


def test_pair_batches_on_the_real_tokenizer(smollm2):
    tok = smollm2.tokenizer
    pairs = date_preference_pairs(3, seed=0)
    batch = collate_pairs(tok, pairs)
    assert batch.ids.shape[0] == 6
    for i, p in enumerate(pairs):
        for row, answer in ((i, p.chosen), (3 + i, p.rejected)):
            keep = batch.labels[row] != IGNORE
            assert tok.decode(batch.ids[row][keep].tolist()) == answer + "<|im_end|>"
        first = int((batch.labels[i] != IGNORE).nonzero()[0])
        assert torch.equal(batch.ids[i, :first], batch.ids[3 + i, :first])  # the same prompt


def test_one_dpo_step_with_lora_on_the_bundled_model(smollm2):
    """The reference is the loaded model itself; the policy a copy with LoRA adapters."""
    from tutorial_lib.lora import add_lora

    reference = smollm2.model
    policy = copy.deepcopy(reference)
    add_lora(policy, 8, 16, generator=torch.Generator().manual_seed(0))
    batch = collate_pairs(smollm2.tokenizer, date_preference_pairs(1, seed=1))  # one pair: two rows
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-3)
    out = dpo_batch_loss(policy, reference, batch, beta=0.1)
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-6)  # LoRA starts as the reference
    out.loss.backward()
    opt.step()
    with torch.no_grad():
        after = dpo_batch_loss(policy, reference, batch, beta=0.1)
    assert (after.margins > 0).all() and after.loss < math.log(2)
