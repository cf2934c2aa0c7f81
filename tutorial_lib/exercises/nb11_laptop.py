"""Exercises of notebook 11 (a real model on a laptop): one Q8_0 block by hand, the nibble
order of Q4_1, and the acceptance rule of speculative sampling."""

from __future__ import annotations

import torch

from .core import Exercise, Mistake

# ---- 11.q8_0_block: d and q of one block ---------------------------------------------------------


def q8_0_block(x):
    """x (32,) float32 -> (d, q): d = max|x| / 127 (float32), q (32,) int8 = x / d rounded half away
    from zero (ggml's roundf), all zeros when the block is."""
    d = x.abs().max() / 127
    if d == 0:
        return d, torch.zeros(32, dtype=torch.int8)
    v = x * (1 / d)
    return d, (v.sign() * torch.floor(v.abs() + 0.5)).to(torch.int8)


def _q8_cases():
    g = torch.Generator().manual_seed(11)
    # max|x| = 63.5 makes d = 0.5 exactly; the other values are (k + 1/2) * d: every x / d is a tie
    ties = torch.cat([(torch.arange(31) - 15 + 0.5) * 0.5, torch.tensor([63.5])])
    return [(torch.randn(32, generator=g),), (torch.randn(32, generator=g) * 1e-3 - 0.01,),
            (torch.cat([torch.randn(31, generator=g), torch.tensor([-40.0])]),), (ties,), (torch.zeros(32),)]


def _q8_signed_max(x):
    d = x.max() / 127  # the largest value, not the largest magnitude
    if d == 0:
        return d, torch.zeros(32, dtype=torch.int8)
    v = x / d
    return d, (v.sign() * torch.floor(v.abs() + 0.5)).clamp(-128, 127).to(torch.int8)


def _q8_by_128(x):
    d = x.abs().max() / 128
    if d == 0:
        return d, torch.zeros(32, dtype=torch.int8)
    v = x / d
    return d, (v.sign() * torch.floor(v.abs() + 0.5)).clamp(-128, 127).to(torch.int8)


def _q8_ties_to_even(x):
    d = x.abs().max() / 127
    if d == 0:
        return d, torch.zeros(32, dtype=torch.int8)
    return d, torch.round(x * (1 / d)).to(torch.int8)


def _q8_truncate(x):
    d = x.abs().max() / 127
    if d == 0:
        return d, torch.zeros(32, dtype=torch.int8)
    return d, (x * (1 / d)).to(torch.int8)  # a cast truncates toward zero


# ---- 11.q4_1_nibbles: 16 packed bytes -> 32 codes -------------------------------------------------


def q4_1_nibbles(packed):
    """packed (16,) uint8 -> (32,) codes 0..15 in element order: byte j holds element j in its
    low nibble and element j + 16 in its high nibble."""
    return torch.cat([packed & 0x0F, packed >> 4])


def _nibble_cases():
    g = torch.Generator().manual_seed(12)
    return [(torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8),) for _ in range(3)] + \
        [(torch.arange(16, dtype=torch.uint8) * 17,)]


def _nibbles_pairs(packed):
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(32)  # (2j, 2j + 1): another format's order


def _nibbles_high_first(packed):
    return torch.cat([packed >> 4, packed & 0x0F])


def _nibbles_no_mask(packed):
    return torch.cat([packed, packed >> 4])  # the low half keeps the high bits too


# ---- 11.acceptance: the verification rule of speculative sampling ---------------------------------


def acceptance(p, q, token):
    """p, q (V,) the model's and the draft's distributions, token drawn from q -> (the probability of
    keeping it, min(1, p[token] / q[token]); the distribution a rejected token is replaced from,
    max(p - q, 0) normalised to sum 1)."""
    keep = torch.clamp(p[token] / q[token], max=1.0)
    residual = (p - q).clamp_min(0)
    return keep, residual / residual.sum()


def _acceptance_cases():
    g = torch.Generator().manual_seed(13)
    cases = []
    for V in (4, 6, 9):
        p = torch.rand(V, generator=g).softmax(-1) if V != 6 else torch.rand(V, generator=g) ** 3
        q = torch.rand(V, generator=g) ** 2
        p, q = p / p.sum(), q / q.sum()
        cases += [(p, q, int(p.argmin())), (p, q, int(p.argmax()))]
    return cases


def _acceptance_no_min(p, q, token):
    residual = (p - q).clamp_min(0)
    return p[token] / q[token], residual / residual.sum()


def _acceptance_residual_p(p, q, token):
    keep = torch.clamp(p[token] / q[token], max=1.0)
    return keep, p / p.sum()  # resamples from p itself: the draft's share is counted twice


def _acceptance_unclamped(p, q, token):
    keep = torch.clamp(p[token] / q[token], max=1.0)
    residual = p - q  # negative entries kept
    return keep, residual / residual.sum()


EXERCISES = [
    Exercise(
        name="11.q8_0_block",
        task="q8_0_block(x): x is one block of 32 float32 values. Return (d, q): d = max|x| / 127 as a float32 "
             "scalar tensor, and q (32,) int8 = x * (1 / d) rounded half away from zero (as C's roundf); an "
             "all-zero block gives d = 0 and q all zeros.",
        cases=_q8_cases,
        reference=q8_0_block,
        forbidden=("quantize", "quantize_symmetric", "round_trip"),
        mistakes={
            "took the largest value, not the largest magnitude": Mistake(
                _q8_signed_max, "The scale must cover the most negative value too: use max|x|."),
            "divided by 128": Mistake(
                _q8_by_128, "Q8_0 keeps the codes symmetric, -127..127: d = max|x| / 127, so that the largest "
                            "magnitude lands exactly on ±127."),
            "rounded ties to even": Mistake(
                _q8_ties_to_even, "torch.round sends 2.5 to 2; ggml's roundf sends it to 3 (half away from zero). "
                                  "Write it as sign(v) * floor(|v| + 0.5)."),
            "truncated instead of rounding": Mistake(
                _q8_truncate, "Casting to int8 cuts toward zero (2.9 -> 2): round first."),
        },
    ),
    Exercise(
        name="11.q4_1_nibbles",
        task="q4_1_nibbles(packed): packed is the 16-byte code part of one Q4_1 block (uint8). Return the 32 "
             "codes 0..15 in element order: byte j holds element j in its low nibble and element j + 16 in its "
             "high nibble.",
        cases=_nibble_cases,
        reference=q4_1_nibbles,
        forbidden=("dequantize", "_nibbles", "_q4_1_parts"),
        mistakes={
            "read the nibbles as neighbouring elements": Mistake(
                _nibbles_pairs, "ggml does not put elements 2j and 2j + 1 in byte j: the low nibbles are "
                                "elements 0..15, the high nibbles elements 16..31."),
            "put the high nibbles first": Mistake(
                _nibbles_high_first, "The low nibble (packed & 15) is the first half of the block."),
            "kept the high bits in the low nibble": Mistake(
                _nibbles_no_mask, "A low nibble is packed & 0x0F: without the mask the byte's high bits stay."),
        },
    ),
    Exercise(
        name="11.acceptance",
        task="acceptance(p, q, token): p and q (V,) are the model's and the draft's next-token distributions and "
             "token was drawn from q. Return (keep, residual): keep = min(1, p[token] / q[token]) as a scalar "
             "tensor, and residual (V,) = max(p - q, 0) normalised to sum 1, the distribution a rejected token "
             "is replaced from.",
        cases=_acceptance_cases,
        reference=acceptance,
        forbidden=("accept_or_resample", "verify_guesses"),
        mistakes={
            "kept p / q without the min": Mistake(
                _acceptance_no_min, "A probability cannot exceed 1: where the model likes the token more than "
                                    "the draft does, it is always kept, min(1, p/q)."),
            "resampled from p itself": Mistake(
                _acceptance_residual_p, "A rejected token must be replaced from what p has beyond q, "
                                        "max(p - q, 0): p itself would count the tokens the draft already "
                                        "proposes twice."),
            "left the negative part in the residual": Mistake(
                _acceptance_unclamped, "p - q is negative where the draft proposes more than the model wants; "
                                       "clamp it at zero before normalising."),
        },
    ),
]
