"""A mixture-of-experts feed-forward network, and the loss that keeps its experts in use.

A dense layer sends every token through one feed-forward network (FFN). A mixture of experts
(Shazeer et al., 2017, "Outrageously Large Neural Networks") holds ``E`` FFNs, the *experts*,
and a linear *router* that scores each token against each of them. The token goes to its
``k`` best-scoring experts only, and the layer's output is their outputs, weighted:

    p = softmax(x W_r^T)                       router probabilities over the E experts
    S = the k experts with the largest p       (top-k)
    y = sum over e in S of  w_e * expert_e(x)

where ``w_e`` is ``p_e`` itself (Switch Transformer, Fedus et al., 2022; Qwen1.5-MoE;
DeepSeek-V2) or ``p_e`` divided by the sum of the k chosen ones (Mixtral, Jiang et al.,
2024). Parameters grow with E, the work per token only with k: "how big is it" gets two
answers, total and active (:mod:`tutorial_lib.params`). Some models add *shared* experts
that every token goes to (DeepSeekMoE, Dai et al., 2024; Qwen1.5-MoE, whose shared expert
is scaled by ``sigmoid(w_g . x)``).

Left alone, a router tends to send most tokens to a few experts, which then get all the
training signal. :func:`load_balancing_loss` is the auxiliary loss of Switch Transformer
(section 2.2), added to the language-model loss with a small weight; `transformers`' Mixtral
implementation provides the same loss (``router_aux_loss_coef``, 0.02 in Mixtral's config.json),
though the Mixtral paper does not describe its training loss.

By default the block is *dropless*: every token reaches all of its k experts, however many
tokens chose the same one. With a *capacity factor* ``cf`` (Switch Transformer, section 2.1)
each expert holds at most ``ceil(cf * N * k / E)`` of a call's N * k (token, choice)
assignments (:func:`expert_capacity`); the assignments past that are dropped
(:func:`capacity_mask`): they add nothing to the output, and the token keeps its residual.
The loop over experts is written out; each expert gathers its tokens, runs on them at once,
and scatters its weighted output back with one ``index_add_``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .checks import check_count, check_number, check_vectors
from .config import ModelConfig
from .layers import FeedForward


class Routing(NamedTuple):
    """What the router decided for N tokens (N = B * T, in row-major order of (B, T))."""

    logits: Tensor  # (N, E) router scores before the softmax
    weights: Tensor  # (N, k) the weight of each chosen expert's output
    experts: Tensor  # (N, k) indices of the chosen experts, the most probable first


class MoEOutput(NamedTuple):
    x: Tensor  # (B, T, d)
    routing: Routing


def _check_logits(logits, k: int) -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = f"{logits.dtype} tensor of shape {tuple(logits.shape)}" if isinstance(logits, Tensor) \
            else type(logits).__name__
        raise ValueError(f"router logits must be a float tensor of shape (tokens, experts), got {got}")
    check_count("k", k, maximum=logits.size(1), why="the number of experts")


def route(logits: Tensor, k: int, renormalise: bool = True) -> tuple[Tensor, Tensor]:
    """Top-k routing: (weights, experts), each (N, k), from router logits (N, E).

    The softmax runs over all E experts (in float32, whatever the logits' dtype); the k most
    probable experts are chosen; their weights are those probabilities, divided by their sum
    when ``renormalise`` (so that they add up to 1). Weights come back in the logits' dtype.
    """
    _check_logits(logits, k)
    probs = logits.float().softmax(dim=-1)  # (N, E)
    weights, experts = probs.topk(k, dim=-1)  # (N, k), best first
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def load_balancing_loss(logits: Tensor, k: int) -> Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al., 2022, equations 4-6), for top-k
    routing as Mixtral uses it, from one layer's router logits (N, E):

        loss = E * sum_i f_i * P_i

    f_i: the fraction of the N tokens that have expert i among their k choices (a count: no
    gradient flows through it); P_i: the router probability of expert i averaged over the
    tokens. Balanced routing (f_i = k / E, P_i = 1 / E) gives k; sending every token to the
    same k experts with certainty gives E. Its gradient lowers the router probability of the
    experts that get more than their share of tokens, and raises the others'.

    This is ``transformers``' ``load_balancing_loss_func`` for one layer. For several layers
    that function pools the counts and probabilities of all layers before multiplying (equal
    to this function on the layers' logits concatenated); :class:`~tutorial_lib.gpt.DecoderOnlyLM`
    averages this loss over its layers instead, balancing each router on its own.
    """
    _check_logits(logits, k)
    E = logits.size(1)
    probs = logits.float().softmax(dim=-1)  # (N, E)
    chosen = probs.topk(k, dim=-1).indices  # (N, k)
    f = expert_counts(chosen, E) / logits.size(0)  # (E,) sums to k
    P = probs.mean(dim=0)  # (E,) sums to 1
    return E * (f * P).sum()


def expert_counts(experts: Tensor, n_experts: int) -> Tensor:
    """How many (token, choice) assignments each expert got: a (n_experts,) int64 count from the
    (N, k) expert indices of a :class:`Routing`. Sums to N * k."""
    if not isinstance(experts, Tensor) or experts.is_floating_point() or experts.is_complex():
        raise ValueError(f"experts must be an integer tensor of expert indices, got {experts!r:.80}")
    if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < n_experts:
        raise ValueError(f"expert indices must lie in [0, {n_experts - 1}], got values from {int(experts.min())} "
                         f"to {int(experts.max())}")
    return torch.bincount(experts.flatten(), minlength=n_experts)


def expert_capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """The slots of one expert: ``ceil(capacity_factor * n_tokens * k / n_experts)``, the even
    share of the ``n_tokens * k`` assignments times the capacity factor. A token picks an expert
    at most once, so an expert never gets more than ``n_tokens``: from ``capacity_factor =
    n_experts / k`` on, nothing can be dropped."""
    check_count("n_experts", n_experts)
    check_count("k", k, maximum=n_experts, why="the number of experts")
    check_count("n_tokens", n_tokens, 0)
    check_number("capacity_factor", capacity_factor, low=0.0, low_open=True)
    return math.ceil(capacity_factor * n_tokens * k / n_experts)


def capacity_mask(experts: Tensor, n_experts: int, capacity_factor: float) -> Tensor:
    """Which assignments fit: an (N, k) bool tensor from the (N, k) expert indices of a
    :class:`Routing`, False where the expert was full.

    An expert's slots fill in order of choice, then of token: first every token's first choice
    (tokens in row-major order of (B, T)), then every token's second choice, and so on; an
    assignment that finds its expert's :func:`expert_capacity` slots taken is dropped. (This is
    one rule among several: implementations also order by router probability, or drop at
    random.)"""
    expert_counts(experts, n_experts)  # for its checks of the indices
    if experts.dim() != 2:
        raise ValueError(f"experts must have shape (tokens, k), got {tuple(experts.shape)}")
    N, k = experts.shape
    capacity = expert_capacity(N, k, n_experts, capacity_factor)
    by_choice = experts.t().reshape(-1)  # (k * N,): all first choices, then all second choices, ...
    one_hot = torch.nn.functional.one_hot(by_choice, n_experts)  # (k * N, E)
    place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # each assignment's place in its expert's queue
    return (place < capacity).reshape(k, N).t()  # (N, k)


class MoEFeedForward(nn.Module):
    """A mixture-of-experts FFN built from a config: a linear router without bias, ``n_experts``
    :class:`~tutorial_lib.layers.FeedForward` experts of width ``expert_dim`` (gated when the
    config's ``ffn`` is), top-``experts_per_token`` routing, and the shared experts when the
    config has them. (B, T, d) -> :class:`MoEOutput` (the output and the :class:`Routing`).

    ``n_shared_experts`` shared experts of width f are built as one FFN of width
    ``n_shared_experts * f``, as DeepSeek's code does: the sum of several FFNs applied to the
    same input equals one FFN whose inner units are theirs side by side (without biases, the
    same parameters and the same output; with biases the merged FFN has one output bias, not
    one per shared expert).

    ``capacity_factor``: None (the default) routes dropless; a number > 0 limits each expert to
    :func:`expert_capacity` assignments per call and drops the rest (:func:`capacity_mask`).
    The capacity counts the tokens of one call, so it depends on the batch. The attribute may be
    changed on a built block, as the notebooks do.
    """

    def __init__(self, cfg: ModelConfig, capacity_factor: float | None = None):
        super().__init__()
        if not cfg.n_experts:
            raise ValueError("MoEFeedForward needs a config with n_experts > 0")
        if capacity_factor is not None:
            check_number("capacity_factor", capacity_factor, low=0.0, low_open=True)
        self.capacity_factor = capacity_factor
        d, bias = cfg.d_model, cfg.uses_bias("ffn")
        self.k, self.renormalise = cfg.experts_per_token, cfg.renormalise_topk
        self.router = nn.Linear(d, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(d, cfg.expert_dim, cfg.ffn, bias=bias, dropout=cfg.dropout)
                                     for _ in range(cfg.n_experts))
        self.shared = None
        if cfg.n_shared_experts:
            self.shared = FeedForward(d, cfg.n_shared_experts * cfg.shared_dim, cfg.ffn, bias=bias, dropout=cfg.dropout)
        self.shared_gate = nn.Linear(d, 1, bias=False) if cfg.shared_expert_gate else None

    def _check_inputs(self, x: Tensor) -> None:
        """Shape and dtype of the input vectors (metadata only: no tensor data is read)."""
        check_vectors("x", x, self.router.in_features)

    def forward(self, x: Tensor) -> MoEOutput:
        self._check_inputs(x)
        flat = x.reshape(-1, x.size(-1))  # (N, d), N = B * T
        logits = self.router(flat)  # (N, E)
        weights, experts = route(logits, self.k, self.renormalise)  # (N, k) each
        chosen = experts
        if self.capacity_factor is not None:  # assignments past an expert's capacity get index -1: never chosen
            chosen = experts.masked_fill(~capacity_mask(experts, len(self.experts), self.capacity_factor), -1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # the tokens that chose e, and in which of their k places
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * weights[token, slot, None]  # gather, run, weight: (n_e, d)
            out.index_add_(0, token, y.to(out.dtype))  # scatter-add back (under autocast y is 16-bit)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, d)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared  # (N, 1) gate per token
            out = out + shared
        return MoEOutput(out.view_as(x), Routing(logits, weights, experts))


@contextlib.contextmanager
def capture_routing(model: nn.Module) -> Iterator[dict[str, Routing]]:
    """Record the routing of every mixture-of-experts layer of ``model`` while the block runs:
    ``{module name: Routing}``, the latest call of each layer (detached). The hooks are
    removed on exit.

        with capture_routing(model) as routed:
            model(ids)
        routed["blocks.1.ffn"].experts  # (B * T, k)
    """
    captured: dict[str, Routing] = {}

    def hook(name):
        def record(module, inputs, output):
            captured[name] = Routing(*(t.detach() for t in output.routing))
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()
               if isinstance(module, MoEFeedForward)]
    if not handles:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts layer to capture")
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
