"""Exercises of notebook 06 (decoder-only language models)."""

from __future__ import annotations

import math

import torch

from .core import Exercise, Mistake


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 06.top_p: nucleus filtering (tutorial_lib.sampling.top_p_filter computes the same) ---------

def top_p_filter(logits, p):
    """Keep, in each row of (..., V), the smallest set of most likely tokens whose probabilities
    sum to at least p, and every token tied with the least likely of them; -inf elsewhere."""
    sorted_logits = logits.sort(dim=-1, descending=True).values  # (..., V): most likely first
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    n_keep = (before < p).sum(dim=-1, keepdim=True)  # >= 1: nothing is ranked above the top token
    smallest_kept = sorted_logits.gather(-1, n_keep - 1)  # (..., 1)
    return logits.masked_fill(logits < smallest_kept, float("-inf"))  # ties with it stay


def _top_p_cases():
    g = _gen(6)
    cases = []
    for p in (0.3, 0.75, 0.9):
        # distinct values (no ties); rows from peaked to flat
        logits = torch.randn(4, 12, generator=g) * torch.tensor([[3.0], [1.5], [0.7], [0.2]])
        cases.append((logits, p))
    peaked = torch.tensor([[4.0, 0.0, -1.0, 0.5, -2.0]])  # top token alone holds ~95 %
    cases += [(peaked, 0.5), (peaked, 0.97)]
    # exactly at the boundary: probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (exact in float32, in a
    # shuffled order), so the two most likely tokens hold exactly 0.75 and the top one exactly 0.5
    halves = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625]).log()[None]
    cases += [(halves, 0.75), (halves, 0.5)]
    # ties at the cut: 2.0 then three tokens of 1.0; the nucleus needs one of them, so all three stay
    tied = torch.tensor([[1.0, -1.0, 1.0, 2.0, 1.0], [0.5, 3.0, 0.5, 0.5, -2.0]])
    cases.append((tied, 0.6))
    return cases


def _drop_mask_in_vocab_order(drop_sorted, order):
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def _top_p_inclusive_cumsum(logits, p):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    return logits.masked_fill(_drop_mask_in_vocab_order(cum > p, order), float("-inf"))


def _top_p_keeps_the_boundary_token(logits, p):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    return logits.masked_fill(_drop_mask_in_vocab_order(before > p, order), float("-inf"))  # keeps before == p


def _top_p_ignores_ties(logits, p):
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    return logits.masked_fill(_drop_mask_in_vocab_order(before >= p, order), float("-inf"))


def _top_p_no_unsort(logits, p):
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    return logits.masked_fill(before >= p, float("-inf"))


def _top_p_ascending(logits, p):
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    return logits.masked_fill(_drop_mask_in_vocab_order(before >= p, order), float("-inf"))


def _top_p_keeps_the_tail(logits, p):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    return logits.masked_fill(_drop_mask_in_vocab_order(before < p, order), float("-inf"))


def _top_p_on_probabilities(logits, p):
    kept = torch.isfinite(top_p_filter(logits, p))
    return logits.softmax(dim=-1) * kept  # probabilities, not logits


# ---- 06.cached_attention: one step of attention with a KV cache -----------------------------

def cached_attention(q, k_new, v_new, past_k=None, past_v=None):
    """q, k_new, v_new: (B, h, T, d) for T new positions; past_k, past_v: (B, h, P, d) or None.

    Append the new keys and values after the cached ones, then let each new query attend
    causally: the query at absolute position P + i sees keys 0 .. P + i. Returns
    (out (B, h, T, d), keys (B, h, P + T, d), values (B, h, P + T, d)).
    """
    keys = k_new if past_k is None else torch.cat([past_k, k_new], dim=-2)
    values = v_new if past_v is None else torch.cat([past_v, v_new], dim=-2)
    T, S = q.size(-2), keys.size(-2)
    allowed = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)  # (T, S), bottom-right
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.size(-1))
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return weights @ values, keys, values


def _cache_cases():
    g = _gen(7)
    B, h, d = 2, 2, 4
    cases = []
    for P, T in ((0, 3), (4, 1), (3, 2)):
        q, k, v = (torch.randn(B, h, T, d, generator=g) for _ in range(3))
        past = (None, None) if P == 0 else tuple(torch.randn(B, h, P, d, generator=g) for _ in range(2))
        cases.append((q, k, v, *past))
    return cases


def _cache_mask_top_left(q, k_new, v_new, past_k=None, past_v=None):
    keys = k_new if past_k is None else torch.cat([past_k, k_new], dim=-2)
    values = v_new if past_v is None else torch.cat([past_v, v_new], dim=-2)
    T, S = q.size(-2), keys.size(-2)
    allowed = torch.ones(T, S, dtype=torch.bool).tril()  # aligned to the first key, not the last
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.size(-1))
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values, keys, values


def _cache_no_mask(q, k_new, v_new, past_k=None, past_v=None):
    keys = k_new if past_k is None else torch.cat([past_k, k_new], dim=-2)
    values = v_new if past_v is None else torch.cat([past_v, v_new], dim=-2)
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.size(-1))
    return scores.softmax(-1) @ values, keys, values


def _cache_overwritten(q, k_new, v_new, past_k=None, past_v=None):
    return cached_attention(q, k_new, v_new)  # the past is thrown away


def _cache_not_updated(q, k_new, v_new, past_k=None, past_v=None):
    out, keys, values = cached_attention(q, k_new, v_new, past_k, past_v)
    if past_k is None:
        return out, keys, values
    return out, past_k, past_v  # attended correctly but returned the old cache


def _cache_prepended(q, k_new, v_new, past_k=None, past_v=None):
    keys = k_new if past_k is None else torch.cat([k_new, past_k], dim=-2)
    values = v_new if past_v is None else torch.cat([v_new, past_v], dim=-2)
    T, S = q.size(-2), keys.size(-2)
    allowed = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.size(-1))
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values, keys, values


# ---- 06.repeat_kv: grouped-query attention (tutorial_lib.attention.repeat_kv computes the same) ----

def repeat_kv(x, n_rep):
    """(B, h_kv, S, d_k) -> (B, h_kv * n_rep, S, d_k): key/value head j serves query heads
    j * n_rep .. j * n_rep + n_rep - 1, so query head i reads key/value head i // n_rep."""
    B, h_kv, S, d_k = x.shape
    grouped = x[:, :, None].expand(B, h_kv, n_rep, S, d_k)  # (B, h_kv, n_rep, S, d_k): n_rep views of each head
    return grouped.reshape(B, h_kv * n_rep, S, d_k)  # neighbours in a group share one key/value head


def _repeat_cases():
    g = _gen(6)
    # (B, h_kv, S, d_k) key/value heads, each to serve n_rep query heads
    return [(torch.randn(2, 2, 5, 3, generator=g), 2), (torch.randn(1, 3, 4, 2, generator=g), 4),
            (torch.randn(2, 4, 3, 2, generator=g), 1), (torch.randn(1, 1, 6, 4, generator=g), 8)]


def _repeat_tiled(x, n_rep):
    return x.repeat(1, n_rep, 1, 1)  # heads 0, 1, 0, 1: query head i reads kv head i % h_kv


def _repeat_positions(x, n_rep):
    return x.repeat_interleave(n_rep, dim=2)  # the positions repeated, not the heads


def _repeat_grouped_axis(x, n_rep):
    B, h_kv, S, d = x.shape
    return x[:, :, None].expand(B, h_kv, n_rep, S, d)  # a group axis, never merged into the heads


# ---- 06.route: a mixture of experts' router (tutorial_lib.moe.route computes the same) -----------

def route(logits, k):
    """Router logits (N, E) -> (weights, experts), each (N, k): the k most probable experts of
    each token, most probable first, and their softmax probabilities divided by their sum."""
    probs = logits.float().softmax(dim=-1)  # (N, E): over all experts
    top = probs.topk(k, dim=-1)  # (N, k) values and indices, most probable first
    weights = top.values / top.values.sum(dim=-1, keepdim=True)  # renormalised: each row sums to 1
    return weights.to(logits.dtype), top.indices


def _route_cases():
    g = _gen(11)
    # (N tokens, E experts) logits, distinct values (no ties), from confident to hesitant routers
    cases = [(torch.randn(6, 4, generator=g) * 2.0, 2), (torch.randn(5, 8, generator=g), 2),
             (torch.randn(4, 8, generator=g) * 0.3, 3), (torch.randn(3, 5, generator=g), 1),
             (torch.randn(2, 3, generator=g), 3)]
    # a router that prefers experts 3 then 0 for every token: the top-2 is not in index order
    cases.append((torch.tensor([[1.5, -1.0, 0.5, 4.0], [2.0, 0.0, -3.0, 2.5]]), 2))
    return cases


def _route_not_renormalised(logits, k):
    top = logits.softmax(dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def _route_softmax_over_tokens(logits, k):
    top = logits.softmax(dim=0).topk(k, dim=-1)
    return top.values / top.values.sum(dim=-1, keepdim=True), top.indices


def _route_least_probable(logits, k):
    top = logits.softmax(dim=-1).topk(k, dim=-1, largest=False)
    return top.values / top.values.sum(dim=-1, keepdim=True), top.indices


def _route_experts_in_index_order(logits, k):
    weights, experts = route(logits, k)
    experts, order = experts.sort(dim=-1)  # ascending expert index, not most probable first
    return weights.gather(-1, order), experts


EXERCISES = [
    Exercise(
        name="06.top_p",
        task="top_p_filter(logits, p): keep, in each row of (..., V), the smallest set of most likely "
             "tokens whose probabilities sum to at least p (the most likely token always stays), and every "
             "token whose logit equals that of the least likely kept token (ties); set every other logit "
             "to -inf and leave the kept logits unchanged.",
        cases=_top_p_cases,
        reference=top_p_filter,
        forbidden=("top_p_filter", "filtered_logits", "Sampler"),
        mistakes={
            "dropped the token that crosses p": Mistake(
                _top_p_inclusive_cumsum, "Comparing the cumulative sum *including* the token with p drops "
                "the token that takes the mass past p, and with a very likely top token keeps nothing. "
                "Compare the mass of the tokens *before* it: cumsum - probs >= p means drop."),
            "kept a token after the mass reached p exactly": Mistake(
                _top_p_keeps_the_boundary_token, "When the tokens before one already hold exactly p, the set "
                "is complete without it: drop a token when the mass before it is >= p, not only > p."),
            "ignored ties at the cut": Mistake(
                _top_p_ignores_ties, "Tokens with the same logit as the least likely kept token must stay "
                "too; otherwise the answer depends on how the sort orders equal values. Keep every logit "
                ">= the smallest kept one."),
            "left the mask in sorted order": Mistake(
                _top_p_no_unsort, "The drop mask is computed on the sorted logits; scatter it back to "
                "vocabulary order with the sort's indices before applying it to the logits."),
            "sorted in ascending order": Mistake(
                _top_p_ascending, "The nucleus is made of the *most* likely tokens: sort with "
                "descending=True so the cumulative sum starts at the top."),
            "kept the tail instead of the nucleus": Mistake(
                _top_p_keeps_the_tail, "The comparison is flipped: a token is dropped once the tokens "
                "before it already reach p (before >= p), so the unlikely tail goes."),
            "returned probabilities": Mistake(
                _top_p_on_probabilities, "Return logits, with -inf where a token is dropped: the "
                "sampler applies the softmax afterwards (and may combine filters first)."),
        },
    ),
    Exercise(
        name="06.cached_attention",
        task="cached_attention(q, k_new, v_new, past_k, past_v): append the new keys and values after "
             "the cached ones (past_k may be None), attend causally from the T new queries, which sit at "
             "positions P..P+T-1, and return (out, keys, values).",
        cases=_cache_cases,
        reference=cached_attention,
        mistakes={
            "causal mask aligned to the first key": Mistake(
                _cache_mask_top_left, "With P cached keys the new queries are the *last* T positions: "
                "query i sits at P + i and may see keys 0 .. P + i. torch.ones(T, S).tril() lets it see "
                "only keys 0 .. i (PyTorch's is_causal=True makes the same mistake when T != S)."),
            "no causal mask": Mistake(
                _cache_no_mask, "When several new tokens arrive at once (a prefill or a chunk), each may "
                "only see the new tokens up to itself: keep the causal mask, aligned bottom-right."),
            "threw the past away": Mistake(
                _cache_overwritten, "The cache exists so that old keys and values are reused: "
                "concatenate past_k and k_new (and the values) along the positions, dim=-2."),
            "returned the old cache": Mistake(
                _cache_not_updated, "The output is right, but the next step will not see this step's "
                "keys and values: return the concatenated keys and values, not past_k and past_v."),
            "new keys put before the old ones": Mistake(
                _cache_prepended, "Positions run forward in time: the new keys go *after* the cached "
                "ones, torch.cat([past_k, k_new], dim=-2), or the causal mask hides the wrong keys."),
        },
    ),
    Exercise(
        name="06.repeat_kv",
        task="repeat_kv(x, n_rep): key/value heads x (B, h_kv, S, d_k) -> (B, h_kv * n_rep, S, d_k) so that "
             "query head i reads key/value head i // n_rep (each kv head serves n_rep neighbouring query heads).",
        cases=_repeat_cases,
        reference=repeat_kv,
        forbidden=("repeat_kv",),
        mistakes={
            "tiled the heads (torch.repeat)": Mistake(
                _repeat_tiled, "x.repeat(1, n_rep, 1, 1) gives heads 0, 1, 0, 1: query head i then reads kv "
                "head i % h_kv. The groups are neighbours, 0, 0, 1, 1: use repeat_interleave on the head axis."),
            "repeated the positions": Mistake(
                _repeat_positions, "Dimension 2 holds the positions; the heads are dimension 1."),
            "kept a separate group axis": Mistake(
                _repeat_grouped_axis, "Right values, wrong shape: (B, h_kv, n_rep, S, d_k) must become "
                "(B, h_kv * n_rep, S, d_k), one axis of heads as the queries have."),
        },
    ),
    Exercise(
        name="06.route",
        task="route(logits, k): router logits (N, E) -> (weights, experts), each (N, k): the k experts "
             "with the largest softmax probability over all E experts, most probable first, and their "
             "probabilities divided by their sum, so that each token's k weights add up to 1.",
        cases=_route_cases,
        reference=route,
        forbidden=("route", "MoEFeedForward"),
        mistakes={
            "did not renormalise": Mistake(
                _route_not_renormalised, "These are the probabilities of the chosen experts over all E: "
                "they sum to less than 1. Divide them by their sum (Mixtral does; Switch and DeepSeek-V2 "
                "keep them as they are, which is a different routing)."),
            "softmax over the tokens": Mistake(
                _route_softmax_over_tokens, "logits has one row per token: the softmax runs over the "
                "experts of each token, dim=-1, not over the tokens, dim=0."),
            "chose the least probable experts": Mistake(
                _route_least_probable, "topk picks the largest values by default; largest=False (or an "
                "ascending sort) picks the experts the router likes least."),
            "experts in index order": Mistake(
                _route_experts_in_index_order, "Right experts and weights, wrong order: return them most "
                "probable first, as topk does, each weight beside its expert."),
        },
    ),
]
