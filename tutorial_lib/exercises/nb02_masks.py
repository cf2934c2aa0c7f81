"""Exercises of notebook 02 (masks)."""

from __future__ import annotations

import torch

from .core import Exercise, Mistake


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 02.decoder_self_mask: causal AND key padding ---------------------------------------------

def decoder_self_mask(lengths, T):
    """(B, 1, T, T) boolean: query i of example b may attend to key j when j <= i and j < lengths[b]."""
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    causal = j <= i                                   # (T, T)
    real_key = j < lengths[:, None]                   # (B, T)
    return (causal[None] & real_key[:, None, :]).unsqueeze(1)


def _decoder_cases():
    return [(torch.tensor([4, 2, 1]), 4), (torch.tensor([5, 3]), 5), (torch.tensor([3]), 3)]


def _only_causal(lengths, T):
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return causal.expand(len(lengths), 1, T, T).clone()


def _only_padding(lengths, T):
    real_key = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    return real_key[:, None, None, :].expand(len(lengths), 1, T, T).clone()


def _upper_triangle(lengths, T):
    upper = torch.ones(T, T, dtype=torch.bool).triu()
    real_key = torch.arange(T)[None, :] < lengths[:, None]
    return (upper[None] & real_key[:, None, :]).unsqueeze(1)


def _strict_triangle(lengths, T):
    strict = torch.ones(T, T, dtype=torch.bool).tril(diagonal=-1)
    real_key = torch.arange(T)[None, :] < lengths[:, None]
    return (strict[None] & real_key[:, None, :]).unsqueeze(1)


def _padding_on_queries(lengths, T):
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    real_query = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    return (causal[None] & real_query[:, :, None]).unsqueeze(1)


def _decoder_blocked(lengths, T):
    return ~decoder_self_mask(lengths, T)


# ---- 02.cached_causal_mask: place the queries at their positions -----------------------------

def cached_causal_mask(query_positions, S):
    """(T, S) boolean causal mask for T new queries at the absolute positions ``query_positions``
    (T,), over a key/value cache with S slots holding positions 0 .. S-1: query i may attend
    to key j when j <= query_positions[i]. Slots after the newest query are not filled yet."""
    return torch.arange(S)[None, :] <= query_positions[:, None]   # (1, S) vs (T, 1) -> (T, S)


def _cached_cases():
    # a pre-allocated cache (queries in the middle), a growing one (queries last), no cache
    return [(torch.tensor([3, 4]), 8), (torch.tensor([4]), 5), (torch.tensor([0, 1, 2]), 3),
            (torch.tensor([2, 3, 4]), 7), (torch.tensor([5]), 9)]


def _top_left(query_positions, S):
    return torch.tril(torch.ones(len(query_positions), S, dtype=torch.bool))


def _last_T_slots(query_positions, S):
    T = len(query_positions)
    return torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)


def _cached_blocked(query_positions, S):
    return ~cached_causal_mask(query_positions, S)


def _cached_diagonal_blocked(query_positions, S):
    return torch.arange(S)[None, :] < query_positions[:, None]


def _cached_float(query_positions, S):
    return cached_causal_mask(query_positions, S).float()


# ---- 02.masked_softmax: no NaN for a row with nothing to attend to --------------------------------

def masked_softmax(scores, mask):
    """Softmax over the last dimension that gives weight 0 to blocked keys (mask False) and a
    row of zeros where every key is blocked."""
    scores = scores.masked_fill(~mask, float("-inf"))
    has_key = mask.any(dim=-1, keepdim=True)
    weights = scores.masked_fill(~has_key, 0.0).softmax(dim=-1)
    return weights.masked_fill(~mask, 0.0)


def _softmax_cases():
    g = _gen(21)
    cases = []
    for rows, cols in ((4, 5), (3, 6)):
        scores = torch.randn(2, rows, cols, generator=g) * 3
        mask = torch.rand(2, rows, cols, generator=g) > 0.4
        mask[..., 0] = True
        mask[..., -1] = False
        mask[1, 1] = False                               # one row with nothing to attend to
        cases.append((scores, mask))
    # scores (B, h, T, S) with a key-padding mask (B, 1, 1, S) that broadcasts over heads and
    # queries; example 1 has no real key at all, so each of its rows is empty
    scores = torch.randn(3, 2, 4, 5, generator=g) * 3
    keep = torch.tensor([[True, True, True, False, False], [False] * 5, [True, False, True, True, False]])
    cases.append((scores, keep[:, None, None, :]))
    return cases


def _naive_nan(scores, mask):
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def _large_negative(scores, mask):
    return scores.masked_fill(~mask, -1e9).softmax(dim=-1)


def _zeroed_after_softmax(scores, mask):
    return scores.softmax(dim=-1).masked_fill(~mask, 0.0)


def _softmax_mask_inverted(scores, mask):
    return masked_softmax(scores, ~mask)


def _softmax_wrong_axis(scores, mask):
    has_key = mask.any(dim=-2, keepdim=True)
    weights = scores.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0).softmax(dim=-2)
    return weights.masked_fill(~mask, 0.0)


# ---- 02.teacher_forcing: inputs and targets of a decoder ------------------------------------------

def teacher_forcing(tokens, bos, eos):
    """tokens (B, L) without BOS/EOS -> (inputs, targets), each (B, L + 1):
    inputs = BOS t_1 .. t_L and targets = t_1 .. t_L EOS, so position i predicts token i + 1."""
    B = tokens.size(0)
    bos_column = torch.full((B, 1), bos, dtype=tokens.dtype)
    eos_column = torch.full((B, 1), eos, dtype=tokens.dtype)
    return torch.cat((bos_column, tokens), dim=1), torch.cat((tokens, eos_column), dim=1)


def _teacher_cases():
    g = _gen(22)
    return [(torch.randint(3, 20, (2, 5), generator=g), 1, 2), (torch.randint(3, 9, (3, 1), generator=g), 0, 1),
            (torch.randint(3, 50, (2, 4), generator=g, dtype=torch.int32), 1, 2)]


def _not_shifted(tokens, bos, eos):
    inputs, _ = teacher_forcing(tokens, bos, eos)
    return inputs, inputs.clone()


def _shifted_backwards(tokens, bos, eos):
    inputs, targets = teacher_forcing(tokens, bos, eos)
    return targets, inputs


def _no_eos(tokens, bos, eos):
    inputs, _ = teacher_forcing(tokens, bos, eos)
    return inputs[:, :-1], tokens.clone()


def _float_ids(tokens, bos, eos):
    B = tokens.size(0)
    ones = torch.ones(B, 1)                              # float32: the cat below turns the ids into floats
    return torch.cat((ones * bos, tokens), dim=1), torch.cat((tokens, ones * eos), dim=1)


EXERCISES = [
    Exercise(
        name="02.decoder_self_mask",
        task="decoder_self_mask(lengths, T): boolean (B, 1, T, T), True where key j <= query i "
             "and key j < lengths[b] (causal AND key padding).",
        cases=_decoder_cases,
        reference=decoder_self_mask,
        mistakes={
            "forgot the padding": Mistake(
                _only_causal, "A causal mask alone lets queries attend to padding keys that "
                              "come before them; AND it with the key-padding mask."),
            "forgot the causal part": Mistake(
                _only_padding, "Padding alone lets every query read the tokens after it, the "
                               "very tokens it has to predict; AND it with a lower triangle."),
            "triangle the wrong way round": Mistake(
                _upper_triangle, "Query i may see keys j <= i: the lower triangle (tril), "
                                 "rows are queries and columns are keys."),
            "query cannot see itself": Mistake(
                _strict_triangle, "The diagonal belongs to the allowed part (j <= i): the token "
                                  "at position i is an input, its target is token i + 1."),
            "padding applied to the queries instead of the keys": Mistake(
                _padding_on_queries, "Padding must be hidden as a *key* (the last dimension); "
                                     "build it from the column index j, not the row index i."),
            "True = blocked (PyTorch's nn convention)": Mistake(
                _decoder_blocked, "In this course True means *may attend*. nn.MultiheadAttention "
                                  "uses the opposite; convert only at that boundary."),
        },
        # the task asks for arange and broadcasting; the library's builders would hand it in
        forbidden=("causal_mask", "padding_mask", "combine", "prefix_lm_mask", "cross_mask", "seq2seq_masks"),
    ),
    Exercise(
        name="02.cached_causal_mask",
        task="cached_causal_mask(query_positions, S): boolean (T, S) mask, True where key position "
             "j <= query_positions[i], for T new queries at the given absolute positions over a "
             "cache of S slots (positions 0 .. S-1, slots after the newest query still empty).",
        cases=_cached_cases,
        reference=cached_causal_mask,
        mistakes={
            "triangle aligned top-left": Mistake(
                _top_left, "torch.tril on a T x S matrix puts query 0 at position 0. With a cache "
                           "the first new query sits at query_positions[0]: compare each key "
                           "position j with the query's position, not with its row index."),
            "queries placed at the last T slots": Mistake(
                _last_T_slots, "That is right for a cache that grows by one slot per token "
                               "(causal_mask(T, S)), not for one allocated in advance: its slots "
                               "after the newest query are empty. Use query_positions."),
            "True = blocked (PyTorch's nn convention)": Mistake(
                _cached_blocked, "True means *may attend* here; you built the blocked part."),
            "diagonal blocked": Mistake(
                _cached_diagonal_blocked, "A query may attend to its own position (<=, not <)."),
            "float mask instead of boolean": Mistake(
                _cached_float, "Right pattern, wrong dtype: masks in this course are boolean. "
                               "F.scaled_dot_product_attention *adds* a float attn_mask to the "
                               "scores, so 0/1 floats would block nothing."),
        },
    ),
    Exercise(
        name="02.masked_softmax",
        task="masked_softmax(scores, mask): softmax over the last dimension with weight 0 at "
             "blocked keys (mask False) and a row of zeros where every key is blocked.",
        cases=_softmax_cases,
        reference=masked_softmax,
        mistakes={
            "NaN where a row is fully masked": Mistake(
                _naive_nan, "softmax of a row that is all -inf is 0/0 = NaN. Give such rows "
                            "finite scores before the softmax and zero their weights after it."),
            "-1e9 instead of -inf": Mistake(
                _large_negative, "With a large finite number a fully masked row becomes uniform: "
                                 "the query attends equally to keys it must not see. Its weights "
                                 "must be zeros."),
            "zeroed the weights after the softmax": Mistake(
                _zeroed_after_softmax, "Blocked keys then still took part in the normalisation, so "
                                       "the remaining weights no longer sum to 1. Mask the scores."),
            "mask inverted": Mistake(
                _softmax_mask_inverted, "True means *may attend*: fill where ~mask, not where mask."),
            "softmax over the wrong axis": Mistake(
                _softmax_wrong_axis, "Each query's weights are normalised over the keys: dim=-1."),
        },
    ),
    Exercise(
        name="02.teacher_forcing",
        task="teacher_forcing(tokens, bos, eos): (inputs, targets) for a decoder, inputs = BOS "
             "followed by the tokens, targets = the tokens followed by EOS.",
        cases=_teacher_cases,
        reference=teacher_forcing,
        mistakes={
            "targets not shifted": Mistake(
                _not_shifted, "Position i must predict the *next* token: targets are the inputs "
                              "shifted one step to the left (and end with EOS)."),
            "shifted the wrong way": Mistake(
                _shifted_backwards, "The input starts with BOS (there is nothing before the first "
                                    "token); the target ends with EOS."),
            "no EOS to predict": Mistake(
                _no_eos, "Without an EOS target the model never learns to stop. Both tensors "
                         "have L + 1 positions."),
            "ids turned into floats": Mistake(
                _float_ids, "torch.ones(B, 1) * bos is a float tensor, and torch.cat promotes the "
                            "ids to float with it; an embedding table refuses float ids. Build "
                            "the column with the ids' dtype: torch.full((B, 1), bos, dtype=tokens.dtype)."),
        },
    ),
]
