"""Exercises of notebook 05 (decoder and encoder-decoder)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .core import Exercise, Mistake

PAD, BOS, EOS = 0, 1, 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _model():
    """A small random encoder-decoder whose greedy outputs end at different steps."""
    from ..transformer import EncoderDecoder

    torch.manual_seed(8)
    cfg = ModelConfig(family="encoder-decoder", vocab_size=9, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                      max_len=16, positions="sinusoidal", init_std=1.0)
    return EncoderDecoder(cfg).eval()


def _sources(B=6, S=7, seed=1):
    g = _gen(seed)
    src = torch.randint(3, 9, (B, S), generator=g)
    lengths = torch.randint(2, S + 1, (B,), generator=g)
    lengths[0] = S
    keep = torch.arange(S) < lengths[:, None]
    return src.masked_fill(~keep, PAD), keep[:, None, None, :]  # (B, S), (B, 1, 1, S)


# ---- 05.shift_right: the decoder input of teacher forcing ----------------------------------------

def shift_right(tgt_out, bos_id):
    """(B, T) targets -> (B, T) decoder input: BOS, then the targets without their last token.

    In a padded batch this puts a row's EOS at its first padded position (case 1), whose label is
    PAD: the loss skips that position, and under the causal mask only later, also unscored,
    positions can read it. ``dates.make_batch`` shifts each target before padding, so PAD
    stands there instead; the logits at every scored position are the same either way."""
    bos = torch.full_like(tgt_out[:, :1], bos_id)
    return torch.cat([bos, tgt_out[:, :-1]], dim=1)


def _shift_cases():
    g = _gen(5)
    return [(torch.randint(3, 14, (2, 5), generator=g), BOS),
            (torch.tensor([[7, 8, 9, EOS, PAD, PAD], [9, 9, 4, 5, 6, EOS]]), BOS),
            (torch.randint(3, 14, (3, 4), generator=g), 13)]


def _no_shift(tgt_out, bos_id):
    return tgt_out.clone()


def _shift_left(tgt_out, bos_id):
    return torch.cat([tgt_out[:, 1:], torch.full_like(tgt_out[:, :1], bos_id)], dim=1)


def _bos_prepended_only(tgt_out, bos_id):
    return torch.cat([torch.full_like(tgt_out[:, :1], bos_id), tgt_out], dim=1)


def _dropped_first(tgt_out, bos_id):
    return torch.cat([torch.full_like(tgt_out[:, :1], bos_id), tgt_out[:, 1:]], dim=1)


# ---- 05.greedy_decode: the decoding loop -------------------------------------------------------------

def greedy_decode(model, src, src_mask, max_len, bos_id, eos_id, pad_id):
    """(B, max_len) ids: from BOS, append the arg-max of the last position's logits max_len times;
    after a sequence's EOS, PAD. BOS itself is not returned."""
    ids = torch.full((src.size(0), 1), bos_id, dtype=torch.long)
    finished = torch.zeros(src.size(0), dtype=torch.bool)
    for _ in range(max_len):
        logits = model(src, ids, src_mask=src_mask).logits[:, -1]  # (B, V)
        next_id = logits.argmax(dim=-1).masked_fill(finished, pad_id)
        finished |= next_id == eos_id
        ids = torch.cat([ids, next_id[:, None]], dim=1)
    return ids[:, 1:]


def _greedy_cases():
    src, src_mask = _sources()
    return [(_model(), src, src_mask, 8, BOS, EOS, PAD),
            (_model(), src[:3, :5], src_mask[:3, ..., :5], 5, BOS, EOS, PAD)]


def _greedy_loop(model, src, src_mask, max_len, bos_id, eos_id, pad_id, *, start=None, position=-1,
                 pad_after_eos=True, keep_bos=False):
    ids = torch.full((src.size(0), 1), bos_id if start is None else start, dtype=torch.long)
    finished = torch.zeros(src.size(0), dtype=torch.bool)
    for _ in range(max_len):
        logits = model(src, ids, src_mask=src_mask).logits[:, position]
        next_id = logits.argmax(dim=-1)
        if pad_after_eos:
            next_id = next_id.masked_fill(finished, pad_id)
        finished |= next_id == eos_id
        ids = torch.cat([ids, next_id[:, None]], dim=1)
    return ids if keep_bos else ids[:, 1:]


def _no_pad_after_eos(model, src, src_mask, max_len, bos_id, eos_id, pad_id):
    return _greedy_loop(model, src, src_mask, max_len, bos_id, eos_id, pad_id, pad_after_eos=False)


def _first_position(model, src, src_mask, max_len, bos_id, eos_id, pad_id):
    return _greedy_loop(model, src, src_mask, max_len, bos_id, eos_id, pad_id, position=0)


def _started_from_pad(model, src, src_mask, max_len, bos_id, eos_id, pad_id):
    return _greedy_loop(model, src, src_mask, max_len, bos_id, eos_id, pad_id, start=pad_id)


def _kept_bos(model, src, src_mask, max_len, bos_id, eos_id, pad_id):
    return _greedy_loop(model, src, src_mask, max_len, bos_id, eos_id, pad_id, keep_bos=True)


# ---- 05.sequence_log_prob: scoring a given answer ------------------------------------------------------

def sequence_log_prob(model, src, src_mask, tgt_out, bos_id, pad_id):
    """(B,) total log-probability of the targets tgt_out (B, T) (EOS included, PAD after it),
    from one teacher-forced pass; PAD positions do not count."""
    tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], bos_id), tgt_out[:, :-1]], dim=1)
    logp = model(src, tgt_in, src_mask=src_mask).logits.log_softmax(dim=-1)  # (B, T, V)
    picked = logp.gather(2, tgt_out[..., None]).squeeze(2)  # (B, T)
    return picked.masked_fill(tgt_out == pad_id, 0.0).sum(dim=1)


def _score_cases():
    src, src_mask = _sources(B=4)
    tgt_out = torch.tensor([[3, 4, 5, EOS, PAD], [6, EOS, PAD, PAD, PAD], [7, 7, 8, 3, EOS], [EOS, PAD, PAD, PAD, PAD]])
    return [(_model(), src, src_mask, tgt_out, BOS, PAD), (_model(), src[:2], src_mask[:2], tgt_out[:2, :3], BOS, PAD)]


def _score(model, src, src_mask, tgt_out, bos_id, pad_id, *, shift=True, mask_pad=True, reduce="sum", probs=False):
    tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], bos_id), tgt_out[:, :-1]], dim=1) if shift else tgt_out
    logp = model(src, tgt_in, src_mask=src_mask).logits.log_softmax(dim=-1)
    picked = logp.gather(2, tgt_out[..., None]).squeeze(2)
    if probs:
        picked = picked.exp()
    real = tgt_out != pad_id
    if mask_pad:
        picked = picked.masked_fill(~real, 0.0)
    if reduce == "mean":
        return picked.sum(dim=1) / (real.sum(dim=1) if mask_pad else tgt_out.size(1))
    return picked.sum(dim=1)


def _score_unshifted(model, src, src_mask, tgt_out, bos_id, pad_id):
    return _score(model, src, src_mask, tgt_out, bos_id, pad_id, shift=False)


def _score_counts_padding(model, src, src_mask, tgt_out, bos_id, pad_id):
    return _score(model, src, src_mask, tgt_out, bos_id, pad_id, mask_pad=False)


def _score_mean(model, src, src_mask, tgt_out, bos_id, pad_id):
    return _score(model, src, src_mask, tgt_out, bos_id, pad_id, reduce="mean")


def _score_probabilities(model, src, src_mask, tgt_out, bos_id, pad_id):
    return _score(model, src, src_mask, tgt_out, bos_id, pad_id, probs=True)


# ---- 05.beam_step: one step of beam search ---------------------------------------------------------------

def beam_step(beam_logp, logp, k):
    """beam_logp (B, k): total log-probability of each live hypothesis; logp (B, k, V): the
    next-token log-probabilities of each. Return (scores, parents, tokens), each (B, k): the k
    best extensions over all k * V, best first: their totals, which hypothesis they extend,
    and the token they add."""
    B, _, V = logp.shape
    totals = (beam_logp[:, :, None] + logp).reshape(B, -1)  # (B, k*V)
    scores, flat = totals.topk(k, dim=-1)
    return scores, flat // V, flat % V


def _beam_cases():
    cases = []
    for seed, (B, k, V) in enumerate(((2, 3, 5), (1, 2, 7), (3, 4, 6))):
        g = _gen(20 + seed)
        beam_logp = -torch.rand(B, k, generator=g) * 3
        logp = torch.randn(B, k, V, generator=g).mul(2).log_softmax(-1)
        cases.append((beam_logp, logp, k))
    return cases


def _best_token_per_beam(beam_logp, logp, k):
    best, token = logp.max(dim=-1)  # (B, k)
    scores, order = (beam_logp + best).sort(dim=-1, descending=True)
    return scores, order, token.gather(1, order)


def _ignored_history(beam_logp, logp, k):
    B, _, V = logp.shape
    _, flat = logp.reshape(B, -1).topk(k, dim=-1)
    scores = (beam_logp[:, :, None] + logp).reshape(B, -1).gather(1, flat)
    return scores, flat // V, flat % V


def _swapped_parent_token(beam_logp, logp, k):
    B, _, V = logp.shape
    scores, flat = (beam_logp[:, :, None] + logp).reshape(B, -1).topk(k, dim=-1)
    return scores, flat % V, flat // V


def _multiplied_log_probs(beam_logp, logp, k):
    B, _, V = logp.shape
    scores, flat = (beam_logp[:, :, None] * logp).reshape(B, -1).topk(k, dim=-1)
    return scores, flat // V, flat % V


EXERCISES = [
    Exercise(
        name="05.shift_right",
        task="shift_right(tgt_out, bos_id): the decoder input for teacher forcing, (B, T) -> (B, T): "
             "BOS first, then the targets without their last token (in a padded row EOS then lands on the "
             "first padded position, which the loss does not score).",
        cases=_shift_cases,
        reference=shift_right,
        mistakes={
            "no shift": Mistake(_no_shift, "The decoder would read the very token it must predict at each "
                                "position: training loss falls to almost 0 and generation fails. Put BOS in "
                                "front and drop the last token."),
            "shifted left": Mistake(_shift_left, "Shift to the right: position t must read the target of "
                                    "position t-1, so BOS goes first, not last."),
            "BOS prepended without dropping the last token": Mistake(
                _bos_prepended_only, "The input must keep the targets' length T: after BOS put "
                                     "tgt_out[:, :-1], not the whole tgt_out."),
            "dropped the first token instead of the last": Mistake(
                _dropped_first, "Keep the first target token (position 1 must read it); it is the last one "
                                "that no position needs to read."),
        },
    ),
    Exercise(
        name="05.greedy_decode",
        task="greedy_decode(model, src, src_mask, max_len, bos_id, eos_id, pad_id): start from BOS and "
             "append the arg-max token max_len times; return (B, max_len) ids without BOS, PAD after each "
             "sequence's EOS.",
        cases=_greedy_cases,
        reference=greedy_decode,
        mistakes={
            "kept generating after EOS": Mistake(
                _no_pad_after_eos, "Once a sequence has produced EOS it is finished: put pad_id in every "
                                   "later position (keep a `finished` flag per sequence)."),
            "took the logits of the first position": Mistake(
                _first_position, "The next token is predicted by the last position: logits[:, -1], "
                                 "not logits[:, 0]."),
            "started from PAD instead of BOS": Mistake(
                _started_from_pad, "The decoder was trained with BOS as its first input; start from "
                                   "torch.full((B, 1), bos_id)."),
            "returned BOS too": Mistake(_kept_bos, "Return only the generated ids: drop the BOS column."),
        },
        forbidden=("greedy_decode", "beam_search"),
    ),
    Exercise(
        name="05.sequence_log_prob",
        task="sequence_log_prob(model, src, src_mask, tgt_out, bos_id, pad_id): the total log-probability "
             "(B,) the model gives the targets tgt_out (B, T) by one teacher-forced pass; PAD positions "
             "do not count.",
        cases=_score_cases,
        reference=sequence_log_prob,
        mistakes={
            "no shift: fed the targets themselves": Mistake(
                _score_unshifted, "The decoder input is BOS followed by tgt_out[:, :-1]; the logits at "
                                  "position t are then scored against tgt_out[:, t]."),
            "counted the padding positions": Mistake(
                _score_counts_padding, "Positions where tgt_out == pad_id are not part of the answer: set "
                                       "their log-probabilities to 0 before summing."),
            "averaged instead of summing": Mistake(
                _score_mean, "The probability of a sequence is the product of its tokens' probabilities, "
                             "so its log-probability is the sum, not the mean."),
            "summed probabilities instead of log-probabilities": Mistake(
                _score_probabilities, "Sum the log-probabilities (log_softmax, then gather); summing "
                                      "probabilities does not give the probability of the sequence."),
        },
        forbidden=("sequence_log_prob", "log_prob_of"),
    ),
    Exercise(
        name="05.beam_step",
        task="beam_step(beam_logp, logp, k): beam_logp (B, k) totals of the live hypotheses, logp (B, k, V) "
             "next-token log-probabilities; return (scores, parents, tokens), each (B, k): the k best "
             "extensions over all k*V, best first.",
        cases=_beam_cases,
        reference=beam_step,
        mistakes={
            "kept the best token of each beam": Mistake(
                _best_token_per_beam, "The k best extensions may come from the same hypothesis: rank all "
                                      "k*V (hypothesis, token) pairs together (flatten, then topk)."),
            "ranked by the new token alone": Mistake(
                _ignored_history, "Rank by the total: beam_logp[:, :, None] + logp. A likely token after an "
                                  "unlikely prefix is not a likely sequence."),
            "parent and token swapped": Mistake(
                _swapped_parent_token, "In the flattened (k*V) index, the hypothesis is index // V and the "
                                       "token is index % V."),
            "multiplied log-probabilities": Mistake(
                _multiplied_log_probs, "Probabilities multiply, so log-probabilities add: "
                                       "beam_logp[:, :, None] + logp."),
        },
    ),
]
