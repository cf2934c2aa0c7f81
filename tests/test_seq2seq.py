"""Seq2seq training and decoding: the label-shift leakage probe, greedy decoding and beam search
(on crafted models whose best sequence is known, and on a real EncoderDecoder), and the
per-layer, per-head attention heatmaps."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tutorial_lib.config import ModelConfig
from tutorial_lib.probes import causal_leakage, label_leakage
from tutorial_lib.sampling import (
    beam_search,
    coverage_penalty,
    greedy_decode,
    length_penalty,
    sequence_log_prob,
)
from tutorial_lib.transformer import DecoderCache, DecoderOutput, EncoderDecoder, StackOutput

PAD, BOS, EOS, A, B_, C = 0, 1, 2, 3, 4, 5
IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)


def real_model(seed=0, vocab=9, init_std=0.5):
    torch.manual_seed(seed)
    cfg = ModelConfig(family="encoder-decoder", vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                      max_len=16, positions="sinusoidal", init_std=init_std)
    return EncoderDecoder(cfg).eval()


def source_batch(B=6, S=7, vocab=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, vocab, (B, S), generator=g)
    lengths = torch.randint(2, S + 1, (B,), generator=g)
    lengths[0] = S
    keep = torch.arange(S) < lengths[:, None]
    return src.masked_fill(~keep, PAD), keep[:, None, None, :]


# ---- teacher forcing: the shift -------------------------------------------------------------


def test_unshifted_labels_are_caught_as_leakage_and_the_shift_passes():
    model = real_model()
    src, src_mask = source_batch(B=3)
    labels = torch.randint(3, 9, (3, 6), generator=torch.Generator().manual_seed(2))

    def shifted(y):
        tgt_in = torch.cat([torch.full_like(y[:, :1], BOS), y[:, :-1]], dim=1)
        return model(src, tgt_in, src_mask=src_mask).logits

    def unshifted(y):  # the bug: the decoder reads the very labels it is scored against
        return model(src, y, src_mask=src_mask).logits

    good, bad = label_leakage(shifted, labels, vocab_size=9), label_leakage(unshifted, labels, vocab_size=9)
    assert good.passed and good.max_difference < 1e-5, str(good)
    assert not bad.passed and bad.first_offending_position == 0, str(bad)
    assert (bad.per_position > 1e-3).all(), "every position reads its own label"
    # The plain causal probe allows position t to see token t, so it cannot see this bug.
    assert causal_leakage(unshifted, labels, vocab_size=9).passed


# ---- a crafted model: next-token probabilities chosen by hand ---------------------------------


class CraftedModel(nn.Module):
    """The interface of EncoderDecoder with hand-set distributions. The distribution of the
    next token is ``table[prefix]`` (prefix: the generated ids so far, BOS excluded), else
    ``default(prefix)``. The prefix is read back from the decoder cache, so decoding that
    reorders the cache wrongly gets the wrong distributions. Cross-attention weights over a
    source of length S are ``attention(prefix)``."""

    def __init__(self, table, vocab=6, default=None, attention=None, S=2):
        super().__init__()
        self.table, self.vocab, self.S = table, vocab, S
        self.default = default or (lambda prefix: {EOS: 0.9})
        self.attention = attention or (lambda prefix: [1.0 / S] * S)
        self.head = nn.Identity()
        self.cfg = SimpleNamespace(max_len=32)
        self.calls = 0

    def probs(self, prefix):
        wanted = self.table.get(tuple(prefix)) or self.default(tuple(prefix))
        rest = (1.0 - sum(wanted.values())) / max(1, self.vocab - len(wanted))
        return torch.tensor([wanted.get(v, rest) for v in range(self.vocab)])

    def encode(self, src, src_mask=None, *, need_weights=False):
        self.calls += 1
        return StackOutput(torch.zeros(src.size(0), src.size(1), 1), None)

    def new_cache(self):
        return DecoderCache(1)

    def decode(self, tokens, memory, src_mask=None, tgt_mask=None, *, cache=None, need_weights=False):
        seen = tokens[:, None, :, None].float()  # (N, 1, T, 1): the ids, kept as "keys"
        history = cache.self_attn[0].append(seen, seen)[0][:, 0, :, 0].long()  # (N, t+1), BOS first
        prefixes = [row[1:].tolist() for row in history]
        logits = torch.stack([self.probs(p).log() for p in prefixes])[:, None]  # (N, 1, V)
        cross = torch.tensor([self.attention(tuple(p)) for p in prefixes])  # (N, S)
        cache.cross[0].append(memory[:, None], memory[:, None])
        return DecoderOutput(logits, None, cross[None, :, None, None, :] if need_weights else None)


def run(model, method, B=1, **kwargs):
    src = torch.zeros(B, model.S, dtype=torch.long)
    return method(model, src, **(dict(max_len=6) | IDS | kwargs))


def as_list(ids):
    return [t for t in ids.tolist() if t != PAD]


# Greedy takes A (0.5) and then C (0.4): 0.20 in all. B then EOS has 0.4 * 0.9 = 0.36.
GREEDY_TRAP = {(): {A: 0.5, B_: 0.4}, (A,): {A: 0.3, B_: 0.3, C: 0.4}, (A, C): {EOS: 0.99},
               (B_,): {EOS: 0.9}}


def test_beam_search_finds_a_more_likely_sequence_than_greedy():
    model = CraftedModel(GREEDY_TRAP)
    greedy = run(model, greedy_decode)
    beam = run(model, beam_search, beam_width=2)
    assert as_list(greedy.ids[0]) == [A, C, EOS]
    assert as_list(beam.ids[0, 0]) == [B_, EOS]
    assert greedy.log_probs.item() == pytest.approx(math.log(0.5 * 0.4 * 0.99), abs=1e-6)
    assert beam.log_probs.item() == pytest.approx(math.log(0.4 * 0.9), abs=1e-6)
    assert beam.log_probs.item() > greedy.log_probs.item()
    assert model.calls == 2, "each search encodes the source once"


def test_beam_width_one_is_greedy():
    model = CraftedModel(GREEDY_TRAP)
    greedy, beam = run(model, greedy_decode), run(model, beam_search, beam_width=1)
    assert as_list(beam.ids[0, 0]) == as_list(greedy.ids[0])
    assert beam.log_probs.item() == pytest.approx(greedy.log_probs.item(), abs=1e-6)


def random_table(vocab, seed):
    """A next-token distribution for every prefix, from a seeded hash of the prefix."""
    def default(prefix):
        g = torch.Generator().manual_seed(seed + sum((t + 1) * 7 ** i for i, t in enumerate(prefix)))
        p = torch.rand(vocab, generator=g) ** 3 + 0.01
        return dict(enumerate((p / p.sum()).tolist()))
    return default


def random_attention(S, seed):
    def attention(prefix):
        g = torch.Generator().manual_seed(seed + 1000 + sum((t + 1) * 5 ** i for i, t in enumerate(prefix)))
        return torch.rand(S, generator=g).softmax(-1).tolist()
    return attention


def exhaustive_best(model, max_len, alpha, beta):
    """Score every sequence (ending in EOS, or cut at max_len) and return the best."""
    best = (-math.inf, None)
    for n in range(1, max_len + 1):
        for seq in itertools.product(range(model.vocab), repeat=n):
            if EOS in seq[:-1] or (seq[-1] != EOS and n < max_len):
                continue
            logp = sum(math.log(model.probs(list(seq[:i]))[t].item()) for i, t in enumerate(seq))
            cov = torch.tensor([model.attention(seq[:i]) for i in range(n)]).sum(0)
            score = logp / ((5 + n) / 6) ** alpha + beta * cov.clamp(max=1).log().sum().item()
            best = max(best, (score, list(seq)))
    return best


@pytest.mark.parametrize("alpha, beta, seed", [(0.0, 0.0, 0), (0.0, 0.0, 1), (1.0, 0.0, 2), (0.6, 0.5, 3)])
def test_a_wide_enough_beam_finds_the_exact_best_sequence(alpha, beta, seed):
    vocab, max_len = 5, 3
    model = CraftedModel({}, vocab=vocab, default=random_table(vocab, seed), attention=random_attention(3, seed), S=3)
    score, seq = exhaustive_best(model, max_len, alpha, beta)
    out = run(model, beam_search, beam_width=vocab ** max_len, max_len=max_len,
              length_penalty_alpha=alpha, coverage_beta=beta)
    assert out.ids[0, 0, : out.lengths[0, 0]].tolist() == seq
    assert out.scores[0, 0].item() == pytest.approx(score, abs=1e-5)


def test_eos_ends_a_hypothesis_and_pad_follows():
    table = {(): {A: 0.9}, (A,): {B_: 0.9}, (A, B_): {EOS: 0.9}}
    model = CraftedModel(table)
    greedy = run(model, greedy_decode, max_len=6)
    assert greedy.ids[0].tolist() == [A, B_, EOS]  # stops as soon as every sequence has ended
    assert greedy.lengths.tolist() == [3]
    beam = run(model, beam_search, beam_width=3, n_best=3, max_len=6)
    for ids, length in zip(beam.ids[0], beam.lengths[0]):
        assert ids[length - 1] == EOS and EOS not in ids[: length - 1].tolist()
        assert (ids[length:] == PAD).all()
    assert beam.ids[0, 0, :3].tolist() == [A, B_, EOS]
    assert (beam.scores[0, :-1] >= beam.scores[0, 1:]).all(), "best first"


def test_sequences_without_eos_stop_at_max_len():
    model = CraftedModel({}, default=lambda prefix: {A: 0.95})  # EOS is never likely
    greedy = run(model, greedy_decode, max_len=4)
    assert greedy.ids[0].tolist() == [A] * 4 and greedy.lengths.tolist() == [4]
    beam = run(model, beam_search, beam_width=2, max_len=4)
    assert beam.ids[0, 0].tolist() == [A] * 4 and beam.lengths[0, 0] == 4
    assert beam.log_probs[0, 0].item() == pytest.approx(4 * math.log(0.95), abs=1e-6)


def test_length_penalty_lets_a_longer_hypothesis_win():
    # EOS now: 0.45. A, A, EOS: 0.40 * 0.97 * 0.97 = 0.376, less likely but longer.
    table = {(): {EOS: 0.45, A: 0.40}, (A,): {A: 0.97}, (A, A): {EOS: 0.97}}
    model = CraftedModel(table)
    plain = run(model, beam_search, beam_width=3, length_penalty_alpha=0.0)
    long = run(model, beam_search, beam_width=3, length_penalty_alpha=1.0)
    assert as_list(plain.ids[0, 0]) == [EOS]
    assert as_list(long.ids[0, 0]) == [A, A, EOS]
    expected = math.log(0.40 * 0.97 * 0.97) / ((5 + 3) / 6)
    assert long.scores[0, 0].item() == pytest.approx(expected, abs=1e-6)
    assert long.log_probs[0, 0].item() < plain.log_probs[0, 0].item()
    torch.testing.assert_close(length_penalty(torch.tensor([1, 3]), 1.0), torch.tensor([1.0, 8 / 6]))
    torch.testing.assert_close(length_penalty(torch.tensor([1, 3]), 0.0), torch.ones(2))


def test_coverage_penalty_prefers_the_hypothesis_that_reads_the_whole_source():
    # A EOS (0.5) looks at source position 0 only; B EOS (0.45) at both positions.
    table = {(): {A: 0.5, B_: 0.45}, (A,): {EOS: 0.99}, (B_,): {EOS: 0.99}}

    def attention(prefix):
        return [1.0, 0.0] if prefix[:1] == (A,) else [0.5, 0.5]

    model = CraftedModel(table, attention=attention)
    assert as_list(run(model, beam_search, beam_width=2).ids[0, 0]) == [A, EOS]
    covered = run(model, beam_search, beam_width=2, coverage_beta=1.0)
    assert as_list(covered.ids[0, 0]) == [B_, EOS]
    assert covered.scores[0, 0].item() == pytest.approx(math.log(0.45 * 0.99), abs=1e-6)  # coverage (1, 1): no cost
    cp = coverage_penalty(torch.tensor([[1.5, 0.5, 0.0]]), torch.tensor([[True, True, False]]), 2.0)
    torch.testing.assert_close(cp, torch.tensor([2.0 * math.log(0.5)]))  # padding is left out


# ---- a real EncoderDecoder --------------------------------------------------------------------


def test_greedy_decoding_equals_a_loop_without_cache_on_a_real_model():
    model = real_model(seed=8, init_std=1.0)  # a seed whose sequences end at different steps
    src, src_mask = source_batch()
    out = greedy_decode(model, src, src_mask, max_len=8, **IDS)
    ids = torch.full((src.size(0), 1), BOS)
    for _ in range(out.ids.size(1)):  # the slow way: the whole prefix every step, no cache
        logits = model(src, ids, src_mask=src_mask).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    for row, expected, n in zip(out.ids, ids[:, 1:], out.lengths):
        assert torch.equal(row[:n], expected[:n]) and (row[n:] == PAD).all()
    assert (out.lengths < 8).any() and (out.lengths > 1).any(), "the crafted cases should end at different steps"
    torch.testing.assert_close(out.log_probs, sequence_log_prob(model, src, out.ids, src_mask, bos_id=BOS,
                                                                pad_id=PAD), atol=1e-5, rtol=0)


def test_beam_search_on_a_real_model_scores_what_it_returns_and_batches_independently():
    model = real_model(seed=8, init_std=1.0)
    src, src_mask = source_batch()
    out = beam_search(model, src, src_mask, beam_width=3, n_best=3, max_len=8, **IDS)
    for j in range(3):
        teacher_forced = sequence_log_prob(model, src, out.ids[:, j], src_mask, bos_id=BOS, pad_id=PAD)
        torch.testing.assert_close(out.log_probs[:, j], teacher_forced, atol=1e-5, rtol=0)
    for b in (1, 4):  # one example alone gives what it got inside the batch
        alone = beam_search(model, src[b:b + 1], src_mask[b:b + 1], beam_width=3, n_best=3, max_len=8, **IDS)
        assert torch.equal(alone.ids[0], out.ids[b, :, : alone.ids.size(-1)])
        torch.testing.assert_close(alone.scores[0], out.scores[b], atol=1e-4, rtol=1e-5)
    greedy = greedy_decode(model, src, src_mask, max_len=8, **IDS)
    width_one = beam_search(model, src, src_mask, beam_width=1, max_len=8, **IDS)
    L = greedy.ids.size(1)
    assert torch.equal(width_one.ids[:, 0, :L], greedy.ids)
    assert (out.log_probs[:, 0] >= greedy.log_probs - 1e-5).any()
    assert not model.training


def test_decoding_restores_training_mode():
    model = real_model().train()
    src, src_mask = source_batch(B=2)
    greedy_decode(model, src, src_mask, max_len=3, **IDS)
    beam_search(model, src, src_mask, max_len=3, **IDS)
    assert model.training


@pytest.mark.parametrize("bad, message", [
    (lambda m, s, k: greedy_decode(m, s, k, max_len=0, **IDS), "max_len"),
    (lambda m, s, k: greedy_decode(m, s, k, max_len=17, **IDS), "model has max_len=16"),
    (lambda m, s, k: greedy_decode(m, s, k.float(), max_len=4, **IDS), "boolean padding mask"),
    (lambda m, s, k: greedy_decode(nn.Linear(2, 2), s, k, max_len=4, **IDS), "encoder-decoder model"),
    (lambda m, s, k: beam_search(m, s, k, max_len=4, beam_width=0, **IDS), "beam_width"),
    (lambda m, s, k: beam_search(m, s, k, max_len=4, beam_width=2, n_best=3, **IDS), "cannot exceed"),
    (lambda m, s, k: beam_search(m, s, k, max_len=4, length_penalty_alpha=-1, **IDS), ">= 0"),
    (lambda m, s, k: beam_search(m, s, k, max_len=4, bos_id=-1, eos_id=EOS, pad_id=PAD), "bos_id"),
])
def test_bad_decoding_arguments_raise(bad, message):
    src, src_mask = source_batch(B=2)
    with pytest.raises(ValueError, match=message):
        bad(real_model(), src, src_mask)


# ---- the per-layer, per-head heatmaps --------------------------------------------------------------


def test_plot_attention_layers_draws_every_layer_and_head_on_one_scale():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tutorial_lib.plotting import plot_attention_layers

    weights = torch.rand(2, 3, 4, 5).softmax(-1)  # (L, h, T, S)
    axes = plot_attention_layers(weights, list("abcd"), list("vwxyz"), title="cross")
    assert axes.shape == (2, 3)
    assert axes[1, 2].get_title() == "layer 1, head 2"
    image = axes[1, 2].get_images()[0]
    assert torch.allclose(torch.as_tensor(image.get_array()), weights[1, 2])
    assert image.get_clim() == (0.0, pytest.approx(weights.max().item()))
    assert [t.get_text() for t in axes[0, 0].get_yticklabels()] == list("abcd")
    assert [t.get_text() for t in axes[0, 1].get_xticklabels()] == list("vwxyz")
    assert "cross" in [t.get_text() for t in axes[0, 0].figure.texts]  # the suptitle
    plt.close("all")
    with pytest.raises(ValueError, match=r"\(layers, heads, T, S\)"):
        plot_attention_layers(weights[0])
    with pytest.raises(ValueError, match="3 query tokens for 4 query positions"):
        plot_attention_layers(weights, list("abc"))
