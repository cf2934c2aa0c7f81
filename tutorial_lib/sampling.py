"""Choosing the next token: greedy, temperature, top-k, top-p; and the generation loop of a
decoder-only model, with or without a KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept); -inf elsewhere."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top-k needs an int k >= 1, got {k!r}")
    if k >= logits.size(-1):
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering (Holtzman et al., 2020): keep the smallest set of most likely tokens
    whose probabilities sum to at least p; -inf elsewhere. The most likely token always stays."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top-p needs 0 < p <= 1, got {p!r}")
    if p == 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    drop_sorted = before >= p  # a token is dropped once the ones before it already reach p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


@dataclass(frozen=True)
class Sampler:
    """How to pick the next token from logits (B, V).

    ``greedy=True`` takes the arg-max. Otherwise: divide by ``temperature`` (> 0), keep the
    ``top_k`` largest (if given), keep the nucleus of mass ``top_p`` (if given), and sample.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0 (use greedy=True for the arg-max), got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")

    def filtered_logits(self, logits: Tensor) -> Tensor:
        """The logits after temperature, top-k and top-p: what the sample is drawn from."""
        logits = logits.float() / self.temperature
        if self.top_k is not None:
            logits = top_k_filter(logits, self.top_k)
        if self.top_p is not None:
            logits = top_p_filter(logits, self.top_p)
        return logits

    def probabilities(self, logits: Tensor) -> Tensor:
        """The distribution the next token is drawn from, (B, V)."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.size(-1)).float()
        return self.filtered_logits(logits).softmax(dim=-1)

    def __call__(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """logits (B, V) -> token ids (B,)."""
        if self.greedy:
            return logits.argmax(dim=-1)
        probs = self.filtered_logits(logits).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


GREEDY = Sampler(greedy=True)


@torch.no_grad()
def generate(model: nn.Module, ids: Tensor, max_new_tokens: int, *, sampler: Sampler = GREEDY,
             use_cache: bool = True, generator: torch.Generator | None = None,
             return_logits: bool = False):
    """Extend ``ids`` (B, T) by ``max_new_tokens`` tokens from a decoder-only model.

    Without a cache every step runs the model on the whole (cropped) context. With a cache
    the prompt is run once (prefill) and every later step runs one token, reading the keys and
    values of earlier positions from the cache. When the context reaches ``max_len``, both
    crop it to the last ``max_len`` tokens, and the cached path refills its cache from that
    window, so both always compute the same thing. The model is put in eval mode for the call
    and restored afterwards. Returns the extended ids (and the logits of every step, (B, N, V),
    with ``return_logits=True``).
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must have shape (B, T), got {tuple(ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    max_len = model.cfg.max_len
    was_training = model.training
    model.eval()
    step_logits = []
    cache = None
    try:
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = model(ids[:, -max_len:]).logits[:, -1]  # (B, V)
            else:
                if cache is None or len(cache) + 1 > max_len:
                    cache = model.new_cache()
                    context = ids[:, -max_len:]  # prefill (again, once the window is full)
                else:
                    context = ids[:, -1:]  # only the newest token
                logits = model(context, cache=cache).logits[:, -1]
            step_logits.append(logits)
            next_id = sampler(logits, generator)  # (B,)
            ids = torch.cat([ids, next_id[:, None]], dim=1)
    finally:
        model.train(was_training)
    if return_logits:
        return ids, torch.stack(step_logits, dim=1) if step_logits else None
    return ids
