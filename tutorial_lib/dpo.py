"""Direct Preference Optimization (DPO, Rafailov et al., 2023), written out.

SFT shows the model good answers. Preference training shows it pairs, a *chosen* answer y+
and a *rejected* one y- to the same prompt x, and asks that the model prefer the first. RLHF
does it in two stages (fit a reward model to the pairs, then maximise the reward with PPO,
held near the SFT model by a KL penalty); DPO shows that the optimum of that problem can be
reached with one classification loss on the policy itself, with a frozen copy of the
starting model as the reference:

    h    = (log pi(y+|x) - log ref(y+|x)) - (log pi(y-|x) - log ref(y-|x))
    loss = -log sigmoid(beta * h)

``log pi(y|x)`` is the sum of the log-probabilities of the answer's tokens given the prompt
(the tokens :mod:`tutorial_lib.sft` counts: the reply and its ``<|im_end|>``). beta * (log pi
- log ref) is the *implicit reward* of an answer; h is how much more the policy has raised
the chosen answer than the rejected one, relative to the reference. Beta sets how far the
policy may drift from the reference (a small beta lets it go far).

The gradient, d loss / d h = -beta * sigmoid(-beta h), is the logistic loss's: a pair the
policy already orders well (h large) weighs little, a pair it gets wrong weighs up to beta.
At the start, policy = reference, h = 0 and the loss is ln 2 for every pair.

The pairs here are the date task's: the chosen answer is the right ISO date, the rejected
one a plausible mistake (day and month swapped, the year off by one, the day off by one).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from datetime import date, timedelta
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_int, check_number
from .dates import FIRST_DATE, LAST_DATE
from .sft import ChatBatch, answer_log_probs, chat_example, collate, date_examples, date_messages

MISTAKES = ("swap", "year", "day")  # how a rejected date is wrong


class PreferencePair(NamedTuple):
    prompt: list[dict[str, str]]  # the messages before the answer
    chosen: str
    rejected: str
    mistake: str  # one of MISTAKES: how the rejected answer is wrong


def wrong_dates(d: date) -> dict[str, str]:
    """The plausible wrong answers for ``d`` that are real dates of the task's range and differ
    from it, by kind: "swap" (day and month swapped: 3 April read as 4 March), "year" (one
    year later, or earlier at the end of the range), "day" (one day later, or earlier)."""
    out = {}
    if d.day <= 12 and d.day != d.month:
        out["swap"] = date(d.year, d.day, d.month)
    for step in (1, -1):
        try:
            w = d.replace(year=d.year + step)
        except ValueError:  # 29 February, in a year without one
            continue
        if FIRST_DATE <= w <= LAST_DATE:
            out["year"] = w
            break
    one_day = timedelta(days=1)
    out["day"] = d + one_day if d < LAST_DATE else d - one_day
    return {kind: w.isoformat() for kind, w in out.items()}


def date_preference_pairs(n: int, *, split: str = "train", seed: int = 0) -> list[PreferencePair]:
    """``n`` pairs on the questions of :func:`tutorial_lib.sft.date_examples` (same split and
    seed): the right date against a wrong one, the kind of mistake drawn by the seed."""
    check_int("seed", seed)
    rng = random.Random(f"mistakes/{split}/{seed}")
    pairs = []
    for e in date_examples(n, split=split, seed=seed):
        wrong = wrong_dates(e.date)
        kind = rng.choice(sorted(wrong))
        pairs.append(PreferencePair(date_messages(e, answer=False), e.target, wrong[kind], kind))
    return pairs


def collate_pairs(tokenizer, pairs: Sequence[PreferencePair], *, pad_id: int = 0, device=None) -> ChatBatch:
    """One :class:`~tutorial_lib.sft.ChatBatch` of 2B rows: the B chosen conversations, then
    the B rejected ones (one forward pass for both), labels on the answers' tokens only."""
    if isinstance(pairs, PreferencePair) or not pairs:
        raise ValueError("collate_pairs needs a non-empty list of PreferencePairs")
    answers = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    rows = [chat_example(tokenizer, [*prompt, {"role": "assistant", "content": a}]) for prompt, a in answers]
    return collate(rows, pad_id=pad_id, device=device)


def sequence_log_probs(model: nn.Module, batch: ChatBatch) -> Tensor:
    """(B,) log p(answer | prompt) of each row: the sum of its counted tokens' log-probs."""
    return answer_log_probs(model(batch.ids).logits, batch.labels)


def frozen_copy(model: nn.Module) -> nn.Module:
    """The reference: a copy of ``model`` in eval mode with every parameter frozen."""
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


class DPOOutput(NamedTuple):
    loss: Tensor  # () the mean of -log sigmoid(beta * margins)
    margins: Tensor  # (B,) h = chosen log-ratio - rejected log-ratio (without beta)
    chosen_rewards: Tensor  # (B,) beta * (log pi - log ref) of the chosen answers
    rejected_rewards: Tensor  # (B,) the same for the rejected ones


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor,
             reference_rejected: Tensor, beta: float = 0.1) -> DPOOutput:
    """The DPO loss from the four (B,) sequence log-probabilities. The outputs keep their
    autograd graph (``margins`` is a node of it: autograd.grad can differentiate by it);
    detach them before keeping them for a plot."""
    check_number("beta", beta, low=0.0, low_open=True)
    named = {"policy_chosen": policy_chosen, "policy_rejected": policy_rejected,
             "reference_chosen": reference_chosen, "reference_rejected": reference_rejected}
    for name, t in named.items():
        if not isinstance(t, Tensor) or t.dim() != 1 or not t.is_floating_point():
            raise ValueError(f"{name} must be float log-probabilities of shape (B,), "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    shapes = {name: tuple(t.shape) for name, t in named.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"the four log-probabilities must be for the same B pairs, got shapes {shapes}")
    chosen_ratio = policy_chosen - reference_chosen  # (B,) log pi / ref of y+
    rejected_ratio = policy_rejected - reference_rejected
    margins = chosen_ratio - rejected_ratio
    loss = -F.logsigmoid(beta * margins).mean()
    return DPOOutput(loss, margins, beta * chosen_ratio, beta * rejected_ratio)


def dpo_batch_loss(policy: nn.Module, reference: nn.Module, batch: ChatBatch, beta: float = 0.1) -> DPOOutput:
    """The DPO loss of a batch from :func:`collate_pairs` (B chosen rows, then B rejected):
    the policy with gradients, the reference without."""
    rows = batch.ids.size(0)
    if rows % 2:
        raise ValueError(f"a batch of pairs has 2B rows (chosen, then rejected), got {rows}")
    B = rows // 2
    policy_logp = sequence_log_probs(policy, batch)  # (2B,)
    with torch.no_grad():
        reference_logp = sequence_log_probs(reference, batch)
    return dpo_loss(policy_logp[:B], policy_logp[B:], reference_logp[:B], reference_logp[B:], beta)


def preference_accuracy(margins: Tensor) -> float:
    """The fraction of pairs whose chosen answer the policy has raised more than the rejected
    one (h > 0), relative to the reference."""
    return (margins > 0).float().mean().item()

