"""Exercises of notebook 03 (positions)."""

from __future__ import annotations

import math

import torch

from .core import Exercise, Mistake


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 03.sinusoidal_table --------------------------------------------------------------------------

def sinusoidal_table(T, d):
    """(T, d): PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d))."""
    position = torch.arange(T, dtype=torch.float64)[:, None]
    frequency = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angle = position * frequency                                              # (T, d/2)
    table = torch.stack((angle.sin(), angle.cos()), dim=-1)                   # (T, d/2, 2)
    return table.reshape(T, d).float()                                        # sin, cos, sin, cos, ...


def _sinusoidal_cases():
    return [(6, 4), (20, 8), (3, 16)]


def _sin_cos_swapped(T, d):
    return sinusoidal_table(T, d).view(T, d // 2, 2).flip(-1).reshape(T, d)


def _halves(T, d):
    table = sinusoidal_table(T, d)
    return torch.cat((table[:, 0::2], table[:, 1::2]), dim=1)


def _exponent_i_over_d(T, d):
    position = torch.arange(T, dtype=torch.float64)[:, None]
    angle = position * 10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) / d)
    return torch.stack((angle.sin(), angle.cos()), dim=-1).reshape(T, d).float()


def _from_one(T, d):
    return sinusoidal_table(T + 1, d)[1:]


# ---- 03.apply_rope ------------------------------------------------------------------------------

def apply_rope(x, base=10000.0):
    """Rotate x (..., T, d) at positions 0..T-1: pair (i, i + d/2) turns by p * base^(-2i/d)."""
    T, d = x.shape[-2:]
    frequency = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)       # (d/2,)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * frequency         # (T, d/2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_cases():
    g = _gen(31)
    return [(torch.randn(2, 5, 8, generator=g), 10000.0), (torch.randn(1, 2, 7, 16, generator=g), 100.0)]


def _adjacent_pairs(x, base=10000.0):
    T, d = x.shape[-2:]
    frequency = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * frequency
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _rotated_clockwise(x, base=10000.0):
    T, d = x.shape[-2:]
    frequency = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * frequency
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def _one_frequency(x, base=10000.0):
    T, d = x.shape[-2:]
    angle = torch.arange(T, dtype=torch.float32)[:, None].expand(T, d // 2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_exponent_i_over_d(x, base=10000.0):
    T, d = x.shape[-2:]
    frequency = base ** (-torch.arange(d // 2, dtype=torch.float32) / d)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * frequency
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---- 03.alibi_slopes ----------------------------------------------------------------------------

def alibi_slopes(n_heads):
    """ALiBi's head slopes as a float tensor (n_heads,): for a power of two n, the geometric
    sequence 2^(-8/n), 2^(-16/n), ..., 2^-8; otherwise the slopes of the largest power of two
    n' < n, followed by every other slope of 2n' until there are n."""
    def geometric(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    if n_heads & (n_heads - 1) == 0:
        return torch.tensor(geometric(n_heads))
    closest = 2 ** int(math.log2(n_heads))
    return torch.tensor(geometric(closest) + geometric(2 * closest)[0::2][: n_heads - closest])


def _slopes_cases():
    return [(8,), (4,), (6,), (12,), (3,)]


def _geometric_for_every_n(n_heads):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)])


def _starts_at_one(n_heads):
    return torch.tensor([2.0 ** (-8.0 * i / n_heads) for i in range(n_heads)])


def _always_halving(n_heads):
    return torch.tensor([2.0 ** -(i + 1) for i in range(n_heads)])


def _first_not_every_other(n_heads):
    if n_heads & (n_heads - 1) == 0:
        return alibi_slopes(n_heads)
    closest = 2 ** int(math.log2(n_heads))
    extra = [2.0 ** (-8.0 * (i + 1) / (2 * closest)) for i in range(n_heads - closest)]
    return torch.cat((alibi_slopes(closest), torch.tensor(extra)))


# ---- 03.alibi_bias --------------------------------------------------------------------------------

def alibi_bias(slopes, T):
    """(h, T, T) additive score bias: -slopes[h] * |i - j| for query i and key j."""
    position = torch.arange(T, dtype=torch.float32)
    distance = (position[:, None] - position[None, :]).abs()   # (T, T)
    return -slopes[:, None, None] * distance                   # (h, T, T)


def _bias_cases():
    return [(torch.tensor([0.5, 0.25, 0.125, 0.0625]), 5), (torch.tensor([2.0 ** -0.5, 2.0 ** -1.5]), 3)]


def _bias_positive(slopes, T):
    return -alibi_bias(slopes, T)


def _bias_signed(slopes, T):
    position = torch.arange(T, dtype=torch.float32)
    return -slopes[:, None, None] * (position[:, None] - position[None, :])


def _bias_no_slope(slopes, T):
    position = torch.arange(T, dtype=torch.float32)
    distance = (position[:, None] - position[None, :]).abs()
    return -distance.expand(len(slopes), T, T).clone()


# Each exercise forbids the library's (and Hugging Face's) version of what it rebuilds.
EXERCISES = [
    Exercise(
        name="03.sinusoidal_table",
        task="sinusoidal_table(T, d): the (T, d) table of Vaswani et al. (2017): "
             "PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)).",
        cases=_sinusoidal_cases,
        reference=sinusoidal_table,
        forbidden=("sinusoidal_table", "SinusoidalPositions"),
        mistakes={
            "sine and cosine swapped": Mistake(
                _sin_cos_swapped, "Even dimensions (0, 2, 4, ...) hold the sine, odd ones the "
                                  "cosine: row 0 is 0, 1, 0, 1, ..."),
            "sines and cosines in two halves": Mistake(
                _halves, "Some code bases put all sines first and all cosines after; that works "
                         "as well, but the paper (and this course) interleaves them: column 2i "
                         "sine, column 2i+1 cosine."),
            "exponent i/d instead of 2i/d": Mistake(
                _exponent_i_over_d, "Pair i uses the exponent 2i/d, so the wavelengths run from "
                                    "2*pi up to 10000*2*pi across the d/2 pairs."),
            "positions counted from 1": Mistake(
                _from_one, "The first position is p = 0 (its row is sin 0 = 0, cos 0 = 1)."),
        },
    ),
    Exercise(
        name="03.apply_rope",
        task="apply_rope(x, base=10000.0): rotate x (..., T, d) at positions p = 0..T-1, pairing "
             "dimension i with i + d/2 (i < d/2) and mapping, with a = p * base^(-2i/d), "
             "(x_i, x_{i+d/2}) -> (x_i cos a - x_{i+d/2} sin a, x_{i+d/2} cos a + x_i sin a).",
        cases=_rope_cases,
        reference=apply_rope,
        forbidden=("apply_rope", "RotaryEmbedding", "apply_rotary_pos_emb", "LlamaRotaryEmbedding"),
        mistakes={
            "paired adjacent dimensions (2i, 2i+1)": Mistake(
                _adjacent_pairs, "That is the pairing of the RoPE paper and GPT-J; it is RoPE "
                                 "too, but weights trained with one pairing do not work with "
                                 "the other. Hugging Face's LLaMA (and this course) pairs i "
                                 "with i + d/2."),
            "rotated clockwise (the other sign convention)": Mistake(
                _rotated_clockwise, "You turned each pair by -a. That is a rotation too, but the "
                                    "task (like Hugging Face's LLaMA) turns by +a: (x_i, x_{i+d/2}) "
                                    "-> (x_i cos a - x_{i+d/2} sin a, x_{i+d/2} cos a + x_i sin a). "
                                    "Weights trained with one sign give wrong answers with the other."),
            "one frequency for every pair": Mistake(
                _one_frequency, "Each pair has its own frequency base^(-2i/d): the first pairs "
                                "turn fast, the last ones slowly."),
            "exponent i/d instead of 2i/d": Mistake(
                _rope_exponent_i_over_d, "The frequencies are base^(-2i/d) for i = 0 .. d/2 - 1 "
                                         "(torch.arange(0, d, 2) / d)."),
        },
    ),
    Exercise(
        name="03.alibi_slopes",
        task="alibi_slopes(n_heads): ALiBi's slopes as a float tensor of shape (n_heads,), with "
             "the rule of the authors' released code for head counts that are not a power of two.",
        cases=_slopes_cases,
        reference=alibi_slopes,
        forbidden=("alibi_slopes", "build_alibi_tensor", "_get_interleave"),
        mistakes={
            "power-of-two formula for every head count": Mistake(
                _geometric_for_every_n, "The geometric sequence 2^(-8/n) ... is for powers of "
                                        "two only. Otherwise: the slopes of the largest power of "
                                        "two n' below n, then every other slope of 2n'."),
            "sequence starts at 2^0": Mistake(
                _starts_at_one, "The first slope is 2^(-8/n) (1/2 for 8 heads), not 1."),
            "always halving": Mistake(
                _always_halving, "The ratio depends on n: 2^(-8/n). Only for 8 heads is it 1/2."),
            "took the first slopes of 2n', not every other one": Mistake(
                _first_not_every_other, "The extra heads take slopes 0, 2, 4, ... of the 2n' "
                                        "sequence ([0::2]), which fall between the slopes of n'."),
        },
    ),
    Exercise(
        name="03.alibi_bias",
        task="alibi_bias(slopes, T): the (h, T, T) bias -slopes[h] * |i - j| added to the score "
             "of query i and key j in head h.",
        cases=_bias_cases,
        reference=alibi_bias,
        forbidden=("alibi_bias", "build_alibi_tensor"),
        mistakes={
            "bias with the wrong sign": Mistake(
                _bias_positive, "ALiBi *penalises* distance: the bias is minus slope times "
                                "distance, so far keys lose score."),
            "signed distance i - j": Mistake(
                _bias_signed, "Use the distance |i - j|: with i - j a key after the query would "
                              "get a bonus instead of a penalty."),
            "forgot the slopes": Mistake(
                _bias_no_slope, "Each head multiplies the distance by its own slope: "
                                "slopes[:, None, None] * distance."),
        },
    ),
]
