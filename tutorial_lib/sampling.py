"""Choosing the next token: greedy, temperature, top-k, top-p; the generation loop of a
decoder-only model, with or without a KV cache; and greedy decoding and beam search for an
encoder-decoder model (notebook 05)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .checks import IdRange, check_count, check_id_tensor, check_id_values
from .fast_decode import FastDecoder, why_not_fast


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept); -inf elsewhere."""
    check_count("k", k, why="top-k keeps the k >= 1 largest logits")
    if k >= logits.size(-1):
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering (Holtzman et al., 2020): keep the smallest set of most likely tokens
    whose probabilities sum to at least p; -inf elsewhere. The most likely token always stays.
    Tokens tied with the least likely kept one are kept too (as in :func:`top_k_filter`), so
    the result depends on the logits' values only, never on how a sort orders ties."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"top-p needs 0 < p <= 1, got {p!r}")
    if p == 1.0:
        return logits
    sorted_logits = logits.sort(dim=-1, descending=True).values
    mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(mass[..., :1]), mass[..., :-1]], dim=-1)  # mass strictly before
    n_keep = (before < p).sum(dim=-1, keepdim=True)  # >= 1: nothing comes before the top token
    smallest_kept = sorted_logits.gather(-1, n_keep - 1)  # (..., 1)
    return logits.masked_fill(logits < smallest_kept, float("-inf"))


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
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not 0 < self.temperature < float("inf")):
            raise ValueError(f"temperature must be > 0 (use greedy=True for the arg-max), got {self.temperature!r}")
        check_count("top_k", self.top_k, optional=True)
        if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                                       or not 0.0 < self.top_p <= 1.0):
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
        # draw where the generator lives (a CPU generator with a GPU model), then move back
        where = probs.device if generator is None else generator.device
        try:
            return torch.multinomial(probs.to(where), 1, generator=generator).squeeze(-1).to(probs.device)
        except RuntimeError:  # checked only when sampling fails: no cost on the way through
            if torch.isfinite(logits).all():
                raise
            raise ValueError(f"the logits hold NaN or infinite values ({int((~torch.isfinite(logits)).sum())} of "
                             f"{logits.numel()}), so there is no distribution to sample from; the model's "
                             "output is broken (check its weights and inputs for NaN)") from None


GREEDY = Sampler(greedy=True)


def generate(model: nn.Module, ids: Tensor, max_new_tokens: int, *, sampler: Sampler = GREEDY,
             use_cache: bool = True, fast: bool = False, generator: torch.Generator | None = None,
             return_logits: bool = False, stop_ids=None, pad_id: int | None = None):
    """Extend ``ids`` (B, T) by ``max_new_tokens`` tokens from a decoder-only model.

    stop_ids: ids that end a sequence (a chat model's end of turn, ``<|im_end|>``). Each row
    stops at its first stop id, which is kept; a row that has stopped gets ``pad_id`` (default:
    the first stop id) while the others go on, and the loop ends when every row has stopped
    or after ``max_new_tokens``. The result then has T + (steps taken) columns.

    Without a cache every step runs the model on the whole (cropped) context. With a cache
    the prompt is run once (prefill) and every later step runs one token, reading the keys and
    values of earlier positions from the cache. When the context reaches ``max_len``, both
    crop it to the last ``max_len`` tokens, and the cached path refills its cache from that
    window, so both always compute the same thing. Every step runs through the model's own
    modules, so a hook or a breakpoint in any of them sees the prompt and every later token.

    ``fast=True`` (with the cache) runs the one-token steps through
    :class:`~tutorial_lib.fast_decode.FastDecoder` instead: the same operations on the same
    weights in one function, without the module calls (the same logits, bit for bit on a CPU;
    notebook 11 will measure what that saves). It cannot run a model whose modules would do
    something it does not (a hook, a part it does not know, a parametrized or compiled module):
    then generate raises a ValueError that says why, rather than quietly running the modules.

    The model is put in eval mode for the call and restored afterwards, and it runs under
    ``torch.inference_mode()`` (no autograd). Returns the extended ids (and the logits of every
    step, (B, N, V), with ``return_logits=True``) as ordinary tensors, usable in a later
    backward pass (unless the caller is itself inside ``inference_mode``).
    """
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "family", None) != "decoder" or not hasattr(model, "new_cache"):
        what = f"family={cfg.family!r}" if hasattr(cfg, "family") else type(model).__name__
        raise ValueError(f"generate extends the ids of a decoder-only language model (family='decoder'), got {what}; "
                         "for an encoder-decoder model use greedy_decode or beam_search")
    check_id_tensor("ids", ids)
    check_id_values(IdRange("ids", ids, cfg.vocab_size))  # once: the model's steps skip it (check_ids=False)
    check_count("max_new_tokens", max_new_tokens, 0)
    if not callable(sampler):
        raise ValueError(f"sampler must be a Sampler, e.g. Sampler(temperature=0.8, top_k=20), got {sampler!r}")
    if not isinstance(fast, bool):
        raise ValueError(f"fast must be True or False, got {fast!r}")
    if fast and not use_cache:
        raise ValueError("fast=True runs the cached one-token steps in one function; it needs use_cache=True")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    stops = _stop_tensor(stop_ids, pad_id, cfg.vocab_size, ids.device)
    was_training = model.training
    model.eval()
    try:
        # inference_mode: no_grad that also skips autograd's bookkeeping of views and
        # in-place writes (a cached step of a small model is mostly such fixed costs)
        with torch.inference_mode():
            ids, step_logits = _extend(model, ids, max_new_tokens, sampler, use_cache, generator, stops, fast)
    finally:
        model.train(was_training)
    # Tensors made under inference_mode cannot be saved for a backward pass; hand back
    # ordinary ones (a copy; stack outside inference_mode makes one), so that generated
    # text can be used as training data.
    ids = ids.clone()
    if return_logits:
        return ids, torch.stack(step_logits, dim=1) if step_logits else None
    return ids


def _stop_tensor(stop_ids, pad_id, vocab_size: int, device) -> tuple[Tensor, int] | None:
    """(the stop ids as a tensor, the pad id), or None without stop ids; checked against V."""
    if stop_ids is None:
        if pad_id is not None:
            raise ValueError("pad_id fills rows that have stopped; it needs stop_ids")
        return None
    if isinstance(stop_ids, int) and not isinstance(stop_ids, bool):
        stop_ids = [stop_ids]
    if not isinstance(stop_ids, (list, tuple, set, frozenset)) or not stop_ids:
        raise ValueError(f"stop_ids must be an id or a non-empty list of ids, got {stop_ids!r}")
    stop_ids = sorted(stop_ids) if isinstance(stop_ids, (set, frozenset)) else list(stop_ids)
    for j, i in enumerate(stop_ids):
        check_count(f"stop_ids[{j}]", i, 0, below=vocab_size, bound_name="vocab_size", why="a token id")
    check_count("pad_id", pad_id, 0, below=vocab_size, bound_name="vocab_size", why="a token id", optional=True)
    return torch.tensor(stop_ids, device=device), stop_ids[0] if pad_id is None else pad_id


def _extend(model: nn.Module, ids: Tensor, max_new_tokens: int, sampler: Sampler, use_cache: bool,
            generator: torch.Generator | None, stops: tuple[Tensor, int] | None = None,
            fast: bool = False) -> tuple[Tensor, list[Tensor]]:
    """The decoding loop of :func:`generate`: (B, T) ids -> (B, T + N) ids, N logits (B, V).

    The prompt was checked by generate and every appended token is an id the sampler picked
    from V logits, so the model is told to skip its checks of the ids (``check_ids=False``).
    The output is allocated once and filled in place: no copy of the ids per step. With the
    cache, the prompt goes through the modules, and so does every one-token step unless
    ``fast``: then a :class:`~tutorial_lib.fast_decode.FastDecoder` runs them (checked here,
    after generate put the model in eval mode, so that training mode is no reason to refuse).
    """
    max_len = model.cfg.max_len
    B, T = ids.shape
    # long as torch.cat([ids, token]) would make it (argmax and multinomial return int64)
    out = ids.new_empty(B, T + max_new_tokens, dtype=torch.long if max_new_tokens else ids.dtype)
    out[:, :T] = ids
    step_logits = []
    cache = None
    fast_step = None
    if fast:
        reason = why_not_fast(model)
        if reason is not None:
            raise ValueError(f"generate(..., fast=True) cannot run this model's steps in FastDecoder: {reason}; "
                             "without fast=True generate runs them through the modules")
        fast_step = FastDecoder(model)
    stopped = None if stops is None else torch.zeros(B, dtype=torch.bool, device=ids.device)
    for end in range(T, T + max_new_tokens):  # out[:, :end] is filled
        if not use_cache:
            logits = model(out[:, max(0, end - max_len):end], check_ids=False).logits[:, -1]  # (B, V)
        elif cache is None or len(cache) + 1 > max_len:
            cache = model.new_cache()
            context = out[:, max(0, end - max_len):end]  # prefill (again, once the window is full)
            logits = model(context, cache=cache, check_ids=False).logits[:, -1]
        elif fast_step is not None:
            logits = fast_step(out[:, end - 1:end], cache)  # only the newest token
        else:
            logits = model(out[:, end - 1:end], cache=cache, check_ids=False).logits[:, -1]
        step_logits.append(logits)
        token = sampler(logits, generator)  # (B,)
        if stopped is None:
            out[:, end] = token
            continue
        out[:, end] = token.masked_fill(stopped, stops[1])  # a row that has stopped is padded
        stopped |= torch.isin(token, stops[0])
        if bool(stopped.all()):  # one host sync per step, only when there are stop ids
            return out[:, :end + 1], step_logits
    return out, step_logits


def chat(model: nn.Module, tokenizer, messages, *, max_new_tokens: int = 128, sampler: Sampler = GREEDY,
         generator: torch.Generator | None = None) -> str:
    """The assistant's reply to ``messages`` ([{"role": "user", "content": ...}, ...]) as text:
    the conversation laid out by the tokenizer's chat template, generated until the end of
    the turn (the tokenizer's ``eos_id``, which for SmolLM2 is ``<|im_end|>``)."""
    if getattr(tokenizer, "eos_id", None) is None:
        raise ValueError("chat needs a tokenizer with a chat template and an eos_id (the end of a turn)")
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)  # (1, T)
    out = generate(model, ids, max_new_tokens, sampler=sampler, generator=generator, stop_ids=[tokenizer.eos_id])
    reply = out[0, len(prompt):].tolist()
    if reply and reply[-1] == tokenizer.eos_id:
        reply = reply[:-1]
    return tokenizer.decode(reply)


# ---- seq2seq decoding: greedy and beam search for an encoder-decoder (notebook 05) -----------
# Both encode the source once and decode one token per step with a DecoderCache, so the
# cross-attention keys/values of the encoder output are projected once per generation.


class Seq2SeqDecoded(NamedTuple):
    ids: Tensor  # (B, L) generated ids (no BOS), EOS included, PAD after it
    log_probs: Tensor  # (B,) total log-probability of those ids, EOS included
    lengths: Tensor  # (B,) number of generated ids, EOS included


class BeamOutput(NamedTuple):
    ids: Tensor  # (B, n_best, L) best first; EOS included (absent when cut at max_len), PAD after
    scores: Tensor  # (B, n_best) log_prob / length_penalty + coverage_penalty: what ranks them
    log_probs: Tensor  # (B, n_best) total log-probability of each hypothesis
    lengths: Tensor  # (B, n_best)


def _check_seq2seq_args(model: nn.Module, src: Tensor, src_mask: Tensor | None, max_len: int,
                        special_ids: dict[str, int]) -> None:
    if not all(hasattr(model, name) for name in ("encode", "decode", "head", "new_cache")):
        raise ValueError(f"expected an encoder-decoder model (encode, decode, head, new_cache), "
                         f"got {type(model).__name__}; for a decoder-only model use generate")
    if not isinstance(src, Tensor) or src.dim() < 2:
        got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
        raise ValueError(f"src must be ids (B, S) or features (B, S, F), got {got}")
    if src_mask is not None and (src_mask.dtype != torch.bool or src_mask.dim() != 4
                                 or src_mask.shape[1:3] != (1, 1) or src_mask.size(-1) != src.size(1)
                                 or src_mask.size(0) not in (1, src.size(0))):
        raise ValueError(f"src_mask must be a boolean padding mask (B, 1, 1, S={src.size(1)}), "
                         f"got {src_mask.dtype} {tuple(src_mask.shape)}")
    check_count("max_len", max_len, why="tokens to generate, EOS included")
    limit = getattr(getattr(model, "cfg", None), "max_len", None)
    if limit is not None and max_len > limit:
        raise ValueError(f"max_len={max_len} needs decoder positions 0..{max_len - 1}, but the model "
                         f"has max_len={limit}")
    check_special_ids(model, special_ids)


def check_special_ids(model: nn.Module, special_ids: dict[str, int]) -> None:
    """Raise ValueError unless every special id (name -> value) is an id of the model's
    target vocabulary: an EOS id the model can never produce would decode to max_len."""
    vocab_size = getattr(getattr(model, "cfg", None), "vocab_size", None)
    for name, value in special_ids.items():
        check_count(name, value, 0, why="a token id")
        if vocab_size is not None and value >= vocab_size:
            raise ValueError(f"{name}={value} is outside the model's target vocabulary [0, {vocab_size - 1}] "
                             f"(vocab_size={vocab_size})")


def _next_log_probs(model: nn.Module, tokens: Tensor, memory: Tensor, src_mask: Tensor | None,
                    cache, need_weights: bool = False):
    """One decoding step: log-probabilities of the next token (N, V), and the cross-attention
    weights of the step (L, N, h, 1, S) when asked for."""
    out = model.decode(tokens, memory, src_mask, cache=cache, need_weights=need_weights)
    logp = model.head(out.x[:, -1]).float().log_softmax(dim=-1)  # (N, V)
    return logp, out.cross_weights


@torch.no_grad()
def greedy_decode(model: nn.Module, src: Tensor, src_mask: Tensor | None = None, *, max_len: int,
                  bos_id: int, eos_id: int, pad_id: int) -> Seq2SeqDecoded:
    """Decode with an encoder-decoder by taking the most likely token at every step.

    The source is encoded once; each step feeds only the newest token and reads earlier
    positions from the decoder cache. A sequence stops at its first EOS (PAD after it); all
    stop after ``max_len`` generated tokens. The model is in eval mode for the call.
    """
    _check_seq2seq_args(model, src, src_mask, max_len, {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id})
    was_training = model.training
    model.eval()
    try:
        memory = model.encode(src, src_mask).x  # (B, S, d): once per generation
        B, device = memory.size(0), memory.device
        cache = model.new_cache()
        token = torch.full((B, 1), bos_id, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        log_probs = torch.zeros(B, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        generated = []
        for _ in range(max_len):
            logp, _ = _next_log_probs(model, token, memory, src_mask, cache)  # (B, V)
            best = logp.argmax(dim=-1)  # (B,)
            log_probs += torch.where(finished, 0.0, logp.gather(1, best[:, None]).squeeze(1))
            lengths += (~finished).long()
            best = best.masked_fill(finished, pad_id)
            generated.append(best)
            finished |= best == eos_id
            if finished.all():
                break
            token = best[:, None]
    finally:
        model.train(was_training)
    return Seq2SeqDecoded(torch.stack(generated, dim=1), log_probs, lengths)


def length_penalty(lengths: Tensor, alpha: float) -> Tensor:
    """The length normaliser of GNMT, Google's Neural Machine Translation system (Wu et al., 2016,
    section 7, eq. 14): ((5 + |Y|) / 6) ** alpha.

    A hypothesis is ranked by log P(Y) / length_penalty: with alpha = 0 by log P(Y) alone,
    which favours short outputs; larger alpha divides longer ones by more.
    """
    return ((5.0 + lengths.float()) / 6.0) ** alpha


def coverage_penalty(coverage: Tensor, source_keep: Tensor, beta: float) -> Tensor:
    """The coverage penalty of GNMT, Google's Neural Machine Translation system (Wu et al., 2016,
    section 7, eq. 14): beta * sum_i log(min(c_i, 1)), where c_i (..., S) is the attention
    weight source position i has received, summed over the output steps.

    GNMT's decoder has one attention module. A Transformer has a cross-attention in every
    decoder layer, with several heads; :func:`beam_search` takes the cross-attention of the
    *last* decoder layer, averaged over its heads (a choice of this library, not GNMT's),
    and sums it over the decoding steps of a hypothesis, the step that wrote EOS included.
    Padded positions (``source_keep`` False) are left out; c_i is floored at 1e-10 so that a
    never-attended position costs a large finite amount, not infinity."""
    covered = coverage.clamp(min=1e-10, max=1.0).log()  # (..., S), <= 0
    return beta * covered.masked_fill(~source_keep, 0.0).sum(dim=-1)


def _reorder_self_attention(cache, index: Tensor) -> None:
    """Keep the decoder cache's self-attention keys/values of the beams in ``index`` (N,).

    The cross-attention keys/values need no reordering: a beam's parent is always a beam of
    the same example, and all beams of one example share the same encoder output.
    """
    for layer in cache.self_attn.layers:
        layer.select(index)


@torch.no_grad()
def beam_search(model: nn.Module, src: Tensor, src_mask: Tensor | None = None, *, max_len: int,
                bos_id: int, eos_id: int, pad_id: int, beam_width: int = 4, n_best: int = 1,
                length_penalty_alpha: float = 0.0, coverage_beta: float = 0.0) -> BeamOutput:
    """Batched beam search for an encoder-decoder.

    Every example keeps ``beam_width`` (k) live hypotheses, ranked by total log-probability.
    At each step the live hypotheses of an example propose their 2k best extensions. Those
    among the best k that end in EOS become finished hypotheses; the best k that do not end
    in EOS stay live (so the beam stays full). Finished hypotheses are ranked by

        score = log P(Y) / length_penalty(|Y|, alpha) + coverage_penalty(beta)

    (|Y| counts EOS; the coverage c_i of source position i is the cross-attention of the
    last decoder layer, averaged over its heads, summed over the steps: see
    :func:`coverage_penalty`). An example stops once it holds
    ``beam_width`` finished hypotheses and no live one can still beat the worst of them:
    a live hypothesis can at best keep its log-probability (each token adds a log-probability
    <= 0) and reach the length penalty of ``max_len``, and the coverage penalty is <= 0.
    Hypotheses still live after ``max_len`` tokens finish without EOS.

    The source is encoded once and repeated for the beams; the decoder cache holds the
    keys/values, reordered when hypotheses change places. With ``beam_width=1`` and
    ``length_penalty_alpha=0`` the result is the greedy one. Returns the ``n_best`` best
    finished hypotheses per example (best first); an example with fewer finite-scoring
    hypotheses than ``n_best`` gets -inf scores in the remaining places.
    """
    _check_seq2seq_args(model, src, src_mask, max_len, {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id})
    check_count("beam_width", beam_width)
    check_count("n_best", n_best)
    if n_best > beam_width:
        raise ValueError(f"n_best ({n_best}) cannot exceed beam_width ({beam_width})")
    if length_penalty_alpha < 0 or coverage_beta < 0:
        raise ValueError("length_penalty_alpha and coverage_beta must be >= 0, got "
                         f"{length_penalty_alpha} and {coverage_beta}")
    k = beam_width
    was_training = model.training
    model.eval()
    try:
        memory = model.encode(src, src_mask).x  # (B, S, d): once per generation
        B, S = memory.shape[:2]
        device = memory.device
        memory = memory.repeat_interleave(k, dim=0)  # (B*k, S, d): beam j of example b at b*k + j
        mask = None if src_mask is None else src_mask.expand(B, -1, -1, -1).repeat_interleave(k, dim=0)
        source_keep = (torch.ones(B * k, S, dtype=torch.bool, device=device) if mask is None
                       else mask[:, 0, 0, :])  # (B*k, S)
        use_coverage = coverage_beta > 0
        coverage = torch.zeros(B * k, S, device=device)
        cache = model.new_cache()
        tokens = torch.full((B * k, 1), bos_id, dtype=torch.long, device=device)
        prefixes = torch.empty(B * k, 0, dtype=torch.long, device=device)  # (B*k, step)
        beam_logp = torch.full((B, k), float("-inf"), device=device)
        beam_logp[:, 0] = 0.0  # all beams start as BOS: keep one, or the first step has k copies
        final_lp = float(length_penalty(torch.tensor(max_len), length_penalty_alpha))
        fin_ids = torch.full((B, k, max_len), pad_id, dtype=torch.long, device=device)
        fin_scores = torch.full((B, k), float("-inf"), device=device)
        fin_logp = torch.full((B, k), float("-inf"), device=device)
        fin_len = torch.zeros(B, k, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        batch_offset = (torch.arange(B, device=device) * k)[:, None]  # (B, 1)

        for step in range(max_len):
            logp, cross = _next_log_probs(model, tokens, memory, mask, cache, use_coverage)  # (B*k, V)
            if use_coverage:
                coverage = coverage + cross[-1, :, :, -1].mean(dim=1)  # last layer, mean over heads: (B*k, S)
            V = logp.size(-1)
            total = (beam_logp.reshape(B * k, 1) + logp).view(B, k * V)  # (B, k*V)
            cand_logp, cand = total.topk(min(2 * k, k * V), dim=-1)  # (B, C), best first
            parent, token = cand // V, cand % V  # (B, C)
            flat_parent = (batch_offset + parent).flatten()  # (B*C,) rows of the beams
            C = cand.size(1)
            cand_ids = torch.cat([prefixes[flat_parent], token.reshape(-1, 1)], dim=1).view(B, C, step + 1)

            # Finished hypotheses: the candidates among the best k that end in EOS (at the last
            # step, all of the best k). The beam is the best k; the next k stand in for those.
            in_beam = torch.arange(C, device=device) < k  # (C,)
            ends = (token == eos_id) if step + 1 < max_len else torch.ones_like(token, dtype=torch.bool)
            ends &= in_beam & ~done[:, None]
            length = torch.full_like(token, step + 1)
            score = cand_logp / length_penalty(length, length_penalty_alpha)
            if use_coverage:
                score = score + coverage_penalty(coverage[flat_parent], source_keep[flat_parent],
                                                 coverage_beta).view(B, C)
            score = score.masked_fill(~ends, float("-inf"))
            padded = torch.full((B, C, max_len), pad_id, dtype=torch.long, device=device)
            padded[:, :, : step + 1] = cand_ids
            pool_scores = torch.cat([fin_scores, score], dim=1)  # (B, k + C)
            fin_scores, keep = pool_scores.topk(k, dim=-1)  # (B, k), best first
            fin_logp = torch.cat([fin_logp, cand_logp], dim=1).gather(1, keep)
            fin_len = torch.cat([fin_len, length], dim=1).gather(1, keep)
            fin_ids = torch.cat([fin_ids, padded], dim=1).gather(1, keep[..., None].expand(-1, -1, max_len))
            if step + 1 == max_len:
                break

            # Live hypotheses: the best k candidates that do not end in EOS. Each beam
            # proposes at most one EOS, so at least k of the 2k candidates qualify.
            order = (token == eos_id).long() * C + torch.arange(C, device=device)  # non-EOS first, by rank
            pick = order.argsort(dim=-1)[:, :k]  # (B, k)
            beam_logp = cand_logp.gather(1, pick)
            chosen = (batch_offset + parent.gather(1, pick)).flatten()  # (B*k,) parent rows
            new_tokens = token.gather(1, pick).reshape(-1, 1)  # (B*k, 1)
            prefixes = torch.cat([prefixes[chosen], new_tokens], dim=1)
            coverage = coverage[chosen]
            _reorder_self_attention(cache, chosen)
            tokens = new_tokens

            best_possible = beam_logp.max(dim=-1).values / final_lp  # (B,)
            done |= fin_scores[:, -1] >= best_possible
            if done.all():
                break
    finally:
        model.train(was_training)
    longest = max(1, int(fin_len[:, :n_best].max()))
    return BeamOutput(fin_ids[:, :n_best, :longest], fin_scores[:, :n_best], fin_logp[:, :n_best],
                      fin_len[:, :n_best])


@torch.no_grad()
def sequence_log_prob(model: nn.Module, src: Tensor, tgt_out: Tensor, src_mask: Tensor | None = None, *,
                      bos_id: int, pad_id: int) -> Tensor:
    """Total log-probability (B,) that the model gives the target ids ``tgt_out`` (B, T)
    (EOS included, PAD after it), by one teacher-forced pass: the decoder reads BOS followed
    by ``tgt_out`` shifted right. PAD positions are left out of the sum."""
    check_id_tensor("tgt_out", tgt_out)
    if not isinstance(src, Tensor) or tgt_out.size(0) != src.size(0):
        got = src.size(0) if isinstance(src, Tensor) else type(src).__name__
        raise ValueError(f"tgt_out must be ids (B, T) for the B={got} examples of src, "
                         f"got shape {tuple(tgt_out.shape)}")
    check_special_ids(model, {"bos_id": bos_id, "pad_id": pad_id})
    vocab_size = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if vocab_size is not None:
        check_id_values(IdRange("tgt_out", tgt_out, vocab_size))
    was_training = model.training
    model.eval()
    try:
        bos = torch.full_like(tgt_out[:, :1], bos_id)
        tgt_in = torch.cat([bos, tgt_out[:, :-1]], dim=1)  # (B, T): shifted right
        logp = model(src, tgt_in, src_mask=src_mask).logits.float().log_softmax(dim=-1)  # (B, T, V)
        picked = logp.gather(2, tgt_out[..., None]).squeeze(2)  # (B, T)
    finally:
        model.train(was_training)
    return picked.masked_fill(tgt_out == pad_id, 0.0).sum(dim=1)
