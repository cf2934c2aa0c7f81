"""The graders of notebooks 06 and 07: each reference passes and agrees with the library, each
named mistake is named, a plausible wrong answer that no mistake describes is still rejected,
and an answer that hands the work to the library function it rebuilds is refused."""

import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import attention, params, sampling
from tutorial_lib.exercises import EXERCISES, check
from tutorial_lib.exercises.core import MISTAKE, PASSED, WRONG, same

NAMES = ["06.top_p", "06.cached_attention", "06.repeat_kv", "07.block_parameters", "07.gpt_parameters",
         "07.kv_cache_bytes", "07.training_flops"]


@pytest.mark.parametrize("name", NAMES)
def test_reference_passes_and_every_named_mistake_is_named(name):
    exercise = EXERCISES[name]
    assert check(name, exercise.reference).status == PASSED
    assert exercise.mistakes, f"{name} names no mistakes"
    for label, mistake in exercise.mistakes.items():
        result = check(name, mistake.fn)
        assert result.status == MISTAKE and f"'{label}'" in result.message, (label, str(result))


def test_written_out_references_agree_with_the_library_on_every_case():
    for logits, p in EXERCISES["06.top_p"].cases():
        got, expected = EXERCISES["06.top_p"].reference(logits, p), sampling.top_p_filter(logits, p)
        assert same(got, expected), f"top-p reference differs from sampling.top_p_filter at p={p}"
    for x, n_rep in EXERCISES["06.repeat_kv"].cases():
        assert torch.equal(EXERCISES["06.repeat_kv"].reference(x, n_rep), attention.repeat_kv(x, n_rep)), n_rep


def test_top_p_has_a_case_exactly_at_the_boundary_and_one_with_ties_at_the_cut():
    cases = EXERCISES["06.top_p"].cases()
    at_boundary = tied = False
    for logits, p in cases:
        probs = logits.sort(dim=-1, descending=True).values.softmax(dim=-1)
        before = probs.cumsum(-1) - probs
        at_boundary |= bool((before == p).any())
        kept = torch.isfinite(EXERCISES["06.top_p"].reference(logits, p))
        smallest = logits.masked_fill(~kept, math.inf).min(-1, keepdim=True).values
        n_needed = (before < p).sum(-1)
        tied |= bool(((logits == smallest) & kept).sum(-1).gt(1).logical_and(kept.sum(-1) > n_needed).any())
    assert at_boundary, "no case puts the mass before a token exactly at p"
    assert tied, "no case has tokens tied with the least likely kept one"


def _top_p_as_top_k(logits, p):
    k = max(1, round(p * logits.size(-1)))  # confuses the nucleus with a fixed number of tokens
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_with_a_cat(logits, p):
    sorted_logits = logits.sort(dim=-1, descending=True).values
    mass = sorted_logits.softmax(-1).cumsum(-1)
    before = torch.cat([torch.zeros_like(mass[..., :1]), mass[..., :-1]], dim=-1)
    smallest_kept = sorted_logits.gather(-1, (before < p).sum(-1, keepdim=True) - 1)
    return logits.masked_fill(logits < smallest_kept, float("-inf"))


def _attention_unscaled(q, k_new, v_new, past_k=None, past_v=None):
    keys = k_new if past_k is None else torch.cat([past_k, k_new], dim=-2)
    values = v_new if past_v is None else torch.cat([past_v, v_new], dim=-2)
    T, S = q.size(-2), keys.size(-2)
    allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    scores = (q @ keys.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))  # no 1/sqrt(d)
    return scores.softmax(-1) @ values, keys, values


def _attention_with_sdpa_and_a_bottom_right_mask(q, k_new, v_new, past_k=None, past_v=None):
    keys = k_new if past_k is None else torch.cat([past_k, k_new], dim=-2)
    values = v_new if past_v is None else torch.cat([past_v, v_new], dim=-2)
    T, S = q.size(-2), keys.size(-2)
    allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed), keys, values


UNNAMED_WRONG = {
    "06.top_p": _top_p_as_top_k,
    "06.cached_attention": _attention_unscaled,
    "06.repeat_kv": lambda x, n_rep: x.repeat_interleave(n_rep, dim=0),  # the batch repeated, not the heads
    "07.block_parameters": lambda d_model, n_heads, n_kv_heads, d_ff, gated, bias: (
        EXERCISES["07.block_parameters"].reference(d_model, n_heads, n_kv_heads, d_ff, gated, bias)
        + (0 if bias else 2 * d_model)),  # RMSNorm counted with a shift
    "07.gpt_parameters": lambda vocab_size, context, d_model, n_layers: (
        EXERCISES["07.gpt_parameters"].reference(vocab_size, context, d_model, n_layers)
        - n_layers * 5 * d_model),  # the FFN's biases forgotten, attention's kept
    "07.kv_cache_bytes": lambda n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value: (
        2 * n_layers * batch * seq_len * (n_heads // n_kv_heads) * head_dim * bytes_per_value),  # the group size
    "07.training_flops": lambda matrix_params, n_layers, context, d_attn: (
        6 * matrix_params + 4 * n_layers * context * d_attn),  # attention left out of the backward pass
}


@pytest.mark.parametrize("name", NAMES)
def test_a_plausible_wrong_answer_that_no_mistake_names_is_rejected(name):
    result = check(name, UNNAMED_WRONG[name])
    assert result.status == WRONG and "case" in result.message, str(result)


def test_other_correct_ways_of_writing_it_pass():
    assert check("06.top_p", _top_p_with_a_cat).status == PASSED
    assert check("06.cached_attention", _attention_with_sdpa_and_a_bottom_right_mask).status == PASSED

    def repeat_with_interleave(x, n_rep):
        return x.repeat_interleave(n_rep, dim=1)

    assert check("06.repeat_kv", repeat_with_interleave).status == PASSED


def _delegates_top_p(logits, p):
    return sampling.top_p_filter(logits, p)


def _delegates_to_the_sampler(logits, p):
    return sampling.Sampler(top_p=p).filtered_logits(logits)


def _delegates_repeat_kv(x, n_rep):
    return attention.repeat_kv(x, n_rep)


def _delegates_block(d_model, n_heads, n_kv_heads, d_ff, gated, bias):
    from tutorial_lib.config import ModelConfig
    cfg = ModelConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff,
                      ffn="swiglu" if gated else "gelu", bias=bias, norm="layernorm" if bias else "rmsnorm")
    return params.block_parameters(cfg)["total"]


def _delegates_kv(n_layers, batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_value):
    from tutorial_lib.config import ModelConfig
    cfg = ModelConfig(d_model=n_heads * head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads, n_layers=n_layers,
                      max_len=seq_len)
    return params.kv_cache_bytes(cfg, batch, seq_len, {4: "fp32", 2: "bf16", 1: "int8"}[bytes_per_value])


@pytest.mark.parametrize("name,fn,used", [
    ("06.top_p", _delegates_top_p, "top_p_filter"),
    ("06.top_p", _delegates_to_the_sampler, "Sampler"),
    ("06.repeat_kv", _delegates_repeat_kv, "repeat_kv"),
    ("07.block_parameters", _delegates_block, "block_parameters"),
    ("07.kv_cache_bytes", _delegates_kv, "kv_cache_bytes"),
])
def test_handing_the_work_to_the_library_is_refused_with_the_name(name, fn, used):
    result = check(name, fn)
    assert result.status == WRONG and used in result.message, str(result)
