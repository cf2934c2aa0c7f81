"""Speculative decoding: prompt lookup proposes what followed the context's tail before; greedy
speculative decoding returns greedy decoding's tokens in fewer forward passes when the guesses
are right and in as many when they are wrong; the acceptance rule and the sampling loop keep
the model's distribution (checked by counting draws); the KV cache forgets rejected guesses."""

import dataclasses

import pytest
import torch

from tutorial_lib.attention import KVCache
from tutorial_lib.config import LLAMA_TINY
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.sampling import Sampler, generate
from tutorial_lib.speculative import accept_or_resample, prompt_lookup, speculative_generate, verify_guesses

CFG = dataclasses.replace(LLAMA_TINY, vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_len=96)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DecoderOnlyLM(CFG).double().eval()  # float64: one-token and k-token products round alike


def test_prompt_lookup_takes_the_longest_and_latest_match():
    context = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 6, 2, 3]
    assert prompt_lookup(context, 2, max_ngram=3) == [7, 8]  # [2, 3] last seen before 7, 8
    assert prompt_lookup(context, 5, max_ngram=1) == [7, 8, 5, 6, 2]  # the tail [3]: its latest earlier place
    assert prompt_lookup([5, 1, 2, 4, 1, 2], 3) == [4, 1, 2]
    # a 3-gram match beats a later 1-gram one
    assert prompt_lookup([7, 8, 9, 1, 4, 9, 0, 7, 8, 9], 2) == [1, 4]
    assert prompt_lookup([1, 2, 3, 4], 3) == []  # the tail never occurred before
    assert prompt_lookup([1, 2, 1, 2], 0) == []
    assert prompt_lookup([3, 4, 3, 4], 3, min_ngram=2) == [3, 4]
    with pytest.raises(ValueError, match="max_ngram"):
        prompt_lookup([1, 2], 2, max_ngram=1, min_ngram=2)


def _oracle(tokens, start):
    """A draft that knows greedy decoding's answer: every guess right."""
    def draft(context, k):
        n = len(context)
        return tokens[n:n + k] if n >= start else []
    return draft


def _always_wrong(model_vocab):
    def draft(context, k):
        return [(context[-1] + 1) % model_vocab] * k
    return draft


def test_greedy_speculation_returns_greedy_tokens(model):
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    plain = generate(model, prompt, 30)
    for draft in (prompt_lookup, _oracle(plain[0].tolist(), prompt.size(1)), _always_wrong(CFG.vocab_size)):
        for k in (1, 3, 6):
            ids, stats = speculative_generate(model, prompt, 30, k=k, draft=draft)
            assert torch.equal(ids, plain), (draft, k)
            assert stats.new_tokens == 30


def test_forward_passes_follow_the_guesses(model):
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    plain = generate(model, prompt, 24)[0].tolist()
    _, right = speculative_generate(model, prompt, 24, k=5, draft=_oracle(plain, 5))
    # each pass keeps its guesses and adds its own token: the prefill's token, then 6 + 6 + 6 + 5
    # (the last draft is cut to the room left beside the model's own token)
    assert right.forward_passes == 1 + 4 and right.accepted == 19 and right.acceptance_rate == 1.0
    _, wrong = speculative_generate(model, prompt, 24, k=5, draft=_always_wrong(CFG.vocab_size))
    assert wrong.forward_passes == 24 and wrong.accepted == 0 and wrong.drafted == 18 * 5 + 4 + 3 + 2 + 1
    assert wrong.tokens_per_pass == pytest.approx(24 / 23)


def test_stop_ids_end_the_sequence_inside_a_kept_draft(model):
    prompt = torch.tensor([[2, 3, 4, 5]])
    plain = generate(model, prompt, 20)[0].tolist()
    stop = plain[4 + 7]  # the eighth new token
    first = plain.index(stop, 4)
    ids, stats = speculative_generate(model, prompt, 20, k=4, draft=_oracle(plain, 4), stop_ids=[stop])
    assert ids[0].tolist() == plain[:first + 1]
    assert stats.new_tokens == first + 1 - 4


def test_the_cache_forgets_rejected_guesses(model):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    cache = model.new_cache()
    model(ids[:, :5], cache=cache)
    model(torch.tensor([[6, 30, 31]]), cache=cache)  # one real token, two guesses to throw away
    cache.crop(6)
    assert len(cache) == 6
    logits = model(ids[:, 6:], cache=cache).logits
    full = model(ids).logits[:, 6:]
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="length"):
        cache.crop(9)
    with pytest.raises(ValueError, match="length"):
        KVCache(2).crop(1)


def test_the_acceptance_rule_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15], dtype=torch.float64)
    q = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.20], dtype=torch.float64)  # a draft far from p
    n = 40000
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    emitted = torch.tensor([accept_or_resample(p, q, int(t), gen)[1] for t in drafts])
    freq = torch.bincount(emitted, minlength=5).double() / n
    # 4 standard errors of a frequency near 0.4 at n = 40000 is 0.01; the draft's own q is 0.3 away
    assert (freq - p).abs().max() < 0.01, freq
    assert (freq - q).abs().max() > 0.2
    kept = sum(accept_or_resample(p, q, int(t), gen)[0] for t in drafts[:20000]) / 20000
    assert kept == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.01)  # P(keep) = sum min(p, q)
    with pytest.raises(ValueError, match="q\\[token\\] > 0"):
        accept_or_resample(p, torch.tensor([1.0, 0, 0, 0, 0], dtype=torch.float64), 2)


def test_sampled_speculation_keeps_the_models_distribution():
    """The first two of three new tokens, 800 runs: the pair frequencies of speculative sampling
    (the second token is a guess of one fixed token, kept or replaced) match the model's exact
    probabilities."""
    torch.manual_seed(3)
    cfg = dataclasses.replace(CFG, vocab_size=6, max_len=16)
    model = DecoderOnlyLM(cfg).double().eval()
    with torch.no_grad():
        model.head.weight.mul_(8.0)  # a peaked distribution, so that the guess is sometimes right
    prompt = torch.tensor([[1, 2, 3]])
    sampler = Sampler(temperature=1.0)
    with torch.no_grad():
        p1 = model(prompt).logits[0, -1].softmax(-1)
        exact = torch.zeros(6, 6, dtype=torch.float64)
        for a in range(6):
            p2 = model(torch.tensor([[1, 2, 3, a]])).logits[0, -1].softmax(-1)
            exact[a] = p1[a] * p2
    guess = int(exact.sum(1).argmax())  # the likeliest first token, guessed every time
    draft = lambda context, k: [guess] * k
    gen = torch.Generator().manual_seed(0)
    n = 800
    counts = torch.zeros(6, 6, dtype=torch.float64)
    accepted = 0
    for _ in range(n):
        ids, stats = speculative_generate(model, prompt, 3, k=1, draft=draft, sampler=sampler, generator=gen)
        a, b = ids[0, 3:5].tolist()
        counts[a, b] += 1
        accepted += stats.accepted
    freq = counts / n
    assert 0 < accepted < n  # the guess was kept sometimes and rejected sometimes
    assert (freq - exact).abs().max() < 0.06, (freq - exact).abs().max()  # 4 standard errors at 0.25
    # a rule that kept every guess would put far more mass on the guessed token
    assert exact[guess].sum() < 0.9


def test_one_verification_draws_from_the_model():
    """verify_guesses with one guess: the token it emits first (the guess kept, or its
    replacement) is distributed as softmax of the first row, whatever the guess."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 0.0]], dtype=torch.float64)
    p = logits[0].softmax(-1)
    sampler = Sampler(temperature=1.0)
    n = 20000
    for guess in (1, 3):
        first = torch.zeros(4, dtype=torch.float64)
        for _ in range(n):
            kept, bonus = verify_guesses(logits, [guess], sampler, gen)
            first[kept[0] if kept else bonus] += 1
        assert (first / n - p).abs().max() < 0.015, (guess, first / n)
    kept, bonus = verify_guesses(logits, [2], Sampler(greedy=True), gen)
    assert kept == [] and bonus == 1
    kept, bonus = verify_guesses(logits, [1], Sampler(greedy=True), gen)
    assert kept == [1] and bonus == 2


def test_bad_arguments(model):
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="one sequence"):
        speculative_generate(model, prompt.repeat(2, 1), 4)
    with pytest.raises(ValueError, match="max_len"):
        speculative_generate(model, prompt, CFG.max_len, k=4)
    with pytest.raises(ValueError, match="k"):
        speculative_generate(model, prompt, 4, k=-1)
    with pytest.raises(ValueError, match="ids"):
        speculative_generate(model, torch.tensor([[1, 2, CFG.vocab_size]]), 4)
    ids, stats = speculative_generate(model, prompt, 0)
    assert torch.equal(ids, prompt) and stats.new_tokens == 0 and stats.forward_passes == 1


def test_k_zero_is_plain_decoding(model):
    prompt = torch.tensor([[4, 4, 4]])
    ids, stats = speculative_generate(model, prompt, 10, k=0)
    assert torch.equal(ids, generate(model, prompt, 10))
    assert stats.forward_passes == 10 and stats.drafted == 0

