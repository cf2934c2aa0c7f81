"""Speculative decoding: a cheap draft proposes tokens, the model checks them in one pass.

At batch 1 a decoding step costs about the same for one position as for five (the weights
are read once either way, notebook 11), so checking k guessed tokens in one forward pass
costs little more than making one. The model's logits at the guessed positions say which
guesses it would have made itself: keep the longest prefix that agrees, plus the model's own
token after it, and drop the cached keys and values of the rest. Every kept token is one the
model chose, so greedy speculative decoding returns the tokens of greedy decoding; only the
number of forward passes changes.

With sampling the rule is the one of Leviathan et al. (2023) and Chen et al. (2023): a
drafted token t, drawn from the draft's distribution q, is kept with probability
min(1, p(t) / q(t)), where p is the model's distribution; a rejected one is replaced by a
sample from the residual max(p - q, 0), renormalised. The kept-or-replaced token is then
distributed exactly as p (:func:`accept_or_resample`, checked statistically in the tests).

The draft here needs no second model: **prompt lookup** (:func:`prompt_lookup`) finds the
last few tokens earlier in the context and proposes what followed them there. It helps where
the output repeats its input (editing, quoting, code) and proposes nothing elsewhere, where
decoding then costs what it always did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .checks import IdRange, check_count, check_id_tensor, check_id_values
from .sampling import GREEDY, Sampler


def prompt_lookup(context: Sequence[int], k: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the context's
    last n tokens, for n from ``max_ngram`` down to ``min_ngram`` (the longest match wins);
    [] when none of them occurred before."""
    check_count("k", k, 0)
    check_count("min_ngram", min_ngram)
    check_count("max_ngram", max_ngram, min_ngram)
    context = list(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(context) <= n:
            continue
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # the latest occurrence before the tail itself
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


def accept_or_resample(p: Tensor, q: Tensor, token: int, generator: torch.Generator | None = None) -> tuple[bool, int]:
    """The verification rule for one drafted ``token`` drawn from the draft's distribution
    ``q`` (V,), against the model's ``p`` (V,). Returns (kept, the token to emit): ``token``
    with probability min(1, p[token] / q[token]), else a sample of max(p - q, 0) renormalised.
    Over the draft's draw and this one, the emitted token is distributed as p."""
    if p.dim() != 1 or p.shape != q.shape:
        raise ValueError(f"p and q must be distributions of the same shape (V,), got {tuple(p.shape)} and "
                         f"{tuple(q.shape)}")
    if not 0 <= token < p.numel() or float(q[token]) <= 0:
        raise ValueError(f"token must be one the draft could draw (q[token] > 0), got {token}")
    ratio = float(p[token]) / float(q[token])
    if ratio >= 1 or float(torch.rand((), generator=generator)) < ratio:
        return True, token
    residual = (p - q).clamp_min(0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


class SpeculativeStats(NamedTuple):
    """What one :func:`speculative_generate` call did."""

    new_tokens: int
    forward_passes: int  # the prefill included
    drafted: int  # tokens the draft proposed
    accepted: int  # of those, kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per forward pass after the prefill (1.0 is plain decoding)."""
        return self.new_tokens / max(1, self.forward_passes - 1)


Draft = Callable[[Sequence[int], int], list[int]]


def speculative_generate(model: nn.Module, ids: Tensor, max_new_tokens: int, *, k: int = 4,
                         draft: Draft = prompt_lookup, sampler: Sampler = GREEDY,
                         generator: torch.Generator | None = None,
                         stop_ids: Sequence[int] = ()) -> tuple[Tensor, SpeculativeStats]:
    """Extend ``ids`` (1, T) by up to ``max_new_tokens`` tokens of a decoder-only model, with
    drafts of up to ``k`` tokens from ``draft(context, k)`` checked in one forward pass each.

    With the greedy sampler the result is greedy decoding's (up to float rounding: the model
    scores k + 1 positions in one product where plain decoding scores one, so a near-tie of two
    logits could break the other way). With a sampler the drafted tokens (a deterministic draft:
    q puts all its mass on the guess) are kept with probability p(guess) and otherwise replaced
    by a sample of p without the guess, which keeps the model's distribution. Stops after a
    token in ``stop_ids`` (kept). Returns (ids (1, T + N), stats).
    """
    check_id_tensor("ids", ids)
    if ids.size(0) != 1:
        raise ValueError(f"speculative_generate decodes one sequence, ids (1, T); got a batch of {ids.size(0)}")
    check_id_values(IdRange("ids", ids, model.cfg.vocab_size))
    check_count("max_new_tokens", max_new_tokens, 0)
    check_count("k", k, 0)
    if ids.size(1) + max_new_tokens + k > model.cfg.max_len:
        raise ValueError(f"the prompt ({ids.size(1)}), the new tokens ({max_new_tokens}) and a draft ({k}) must fit "
                         f"the model's max_len={model.cfg.max_len}")
    stops = {int(s) for s in stop_ids}
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return _speculate(model, ids, max_new_tokens, k, draft, sampler, generator, stops)
    finally:
        model.train(was_training)


def _next_token(probs_or_logits: Tensor, sampler: Sampler, generator) -> int:
    return int(sampler(probs_or_logits[None], generator)[0])


def _speculate(model, ids, max_new_tokens, k, draft, sampler, generator, stops):
    out = ids[0].tolist()
    target = len(out) + max_new_tokens
    cache = model.new_cache()
    logits = model(ids, cache=cache, check_ids=False).logits[0, -1]  # (V,): the prefill
    passes, drafted, accepted = 1, 0, 0
    pending = [_next_token(logits, sampler, generator)] if max_new_tokens else []
    while pending:
        for t in pending:  # the cache holds every position of out but the last pending token
            out.append(t)
            if t in stops or len(out) == target:
                return _finish(out, ids, passes, drafted, accepted)
        token = out[-1]
        guess = list(draft(out, min(k, target - len(out) - 1)))[:k]  # room for the bonus token
        step = torch.tensor([[token] + guess], device=ids.device)  # (1, 1 + n)
        logits = model(step, cache=cache, check_ids=False).logits[0]  # (1 + n, V): after each fed token
        passes += 1
        drafted += len(guess)
        kept, bonus = verify_guesses(logits, guess, sampler, generator)
        accepted += len(kept)
        cache.crop(len(out) + len(kept))  # drop the keys and values of the rejected guesses
        pending = kept + [bonus]
    return _finish(out, ids, passes, drafted, accepted)


def _finish(out, ids, passes, drafted, accepted):
    stats = SpeculativeStats(len(out) - ids.size(1), passes, drafted, accepted)
    return torch.tensor([out], device=ids.device, dtype=torch.long), stats


def verify_guesses(logits: Tensor, guess: list[int], sampler: Sampler, generator) -> tuple[list[int], int]:
    """One verification: ``logits`` (1 + n, V) are the model's scores after the last kept token
    and after each of the n guesses. Returns (the guesses kept, the model's token after them):
    guess i is checked against row i; the first rejected one is replaced by a draw from row i
    without it, and when every guess is kept the last row gives a bonus token. Greedy: a guess
    is kept when it is the row's arg-max, and the arg-max replaces it otherwise."""
    if sampler.greedy:
        choice = logits.argmax(-1).tolist()
        n = 0
        while n < len(guess) and guess[n] == choice[n]:
            n += 1
        return guess[:n], choice[n]
    probs = sampler.probabilities(logits)  # (1 + n, V)
    for i, t in enumerate(guess):
        # a deterministic draft puts all of q on its guess: kept with probability p(t), else a draw of p without t
        kept, token = accept_or_resample(probs[i], torch.nn.functional.one_hot(torch.tensor(t), probs.size(-1))
                                         .to(probs.dtype), t, generator)
        if not kept:
            return guess[:i], token
    return guess, int(torch.multinomial(probs[len(guess)], 1, generator=generator))
