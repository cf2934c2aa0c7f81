"""The sampling playground of notebook 06: the pure render function draws the distribution the
sampler draws from, and the widget re-renders (new bars, new samples) when a slider moves."""

import dataclasses

import numpy as np
import pytest
import torch

from tutorial_lib.config import GPT_TINY
from tutorial_lib.data import CharTokenizer
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.sampling import Sampler
from tutorial_lib.widgets import SamplingPlayground, render_sampling, sampling_playground, token_label

LABELS = list("abcdefgh")
LOGITS = torch.tensor([2.0, 0.5, 1.0, -1.0, 0.0, 1.5, -2.0, 0.2])


def bars(fig):
    ax = fig.axes[0]
    model, drawn = ax.containers[:2]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    return labels, np.array([b.get_height() for b in model]), np.array([b.get_height() for b in drawn])


def test_render_shows_the_most_likely_tokens_and_the_filtered_distribution():
    fig = render_sampling(LOGITS, LABELS, temperature=0.7, top_k=3, n_show=5)
    labels, model, drawn = bars(fig)
    assert labels == ["a", "f", "c", "b", "h"], "the five most likely, most likely first"
    order = [0, 5, 2, 1, 7]
    np.testing.assert_allclose(model, LOGITS.softmax(-1)[order].numpy(), rtol=1e-6)
    expected = Sampler(temperature=0.7, top_k=3).probabilities(LOGITS[None])[0][order].numpy()
    np.testing.assert_allclose(drawn, expected, rtol=1e-6)
    assert drawn[3] == drawn[4] == 0.0, "tokens outside the top 3 cannot be drawn"
    title = fig.axes[0].get_title()
    assert "3 of 8 tokens can be drawn" in title and "top-k 3" in title
    assert fig.axes[0].get_xlabel() and fig.axes[0].get_ylabel()


def test_render_with_top_p_and_samples_adds_a_text_panel():
    fig = render_sampling(LOGITS, LABELS, top_p=0.5, samples=["ab\ncd", "ef"])
    _, _, drawn = bars(fig)
    assert (drawn > 0).sum() == 2  # 0.40 + 0.25 reach 0.5
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert texts == ["1: ab⏎cd\n2: ef"]


def test_render_refuses_bad_settings_and_shapes():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        render_sampling(LOGITS, LABELS, temperature=0)
    with pytest.raises(ValueError, match="top_p must lie in"):
        render_sampling(LOGITS, LABELS, top_p=1.5)
    with pytest.raises(ValueError, match="7 labels for a vocabulary of 8"):
        render_sampling(LOGITS, LABELS[:7])
    with pytest.raises(ValueError, match="shape \\(V,\\)"):
        render_sampling(LOGITS[None], LABELS)


def test_token_labels_make_whitespace_visible():
    assert [token_label(c) for c in "\n a"] == ["\\n", "␣", "a"]


@pytest.fixture(scope="module")
def tiny():
    tok = CharTokenizer.from_text("the quick brown fox jumps over the lazy dog\n")
    torch.manual_seed(0)
    cfg = dataclasses.replace(GPT_TINY, vocab_size=tok.vocab_size, d_model=32, n_layers=1, max_len=48)
    return DecoderOnlyLM(cfg).eval(), tok


def test_playground_rerenders_bars_and_samples_when_a_slider_moves(tiny):
    model, tok = tiny
    play = SamplingPlayground(model, tok, "the ", n_samples=2, length=12, seed=1)
    before_png, before_samples = play.image.value, play.samples()
    assert before_png[:4] == b"\x89PNG"
    assert len(before_samples) == 2 and all(len(s) == 12 for s in before_samples)
    assert play.samples() == before_samples, "the same settings and seed give the same samples"
    play.top_k.value = 1
    assert play.settings() == {"temperature": 1.0, "top_k": 1, "top_p": None}
    _, _, drawn = bars(play._figure)
    assert (drawn > 0).sum() == 1 and drawn.max() == pytest.approx(1.0)
    assert play.image.value != before_png
    assert len(set(play.samples())) == 1, "top-k 1 is greedy: every sample is the same"
    play.top_k.value, play.top_p.value = 0, 0.3
    assert play.settings()["top_p"] == pytest.approx(0.3) and play.settings()["top_k"] is None


def test_static_fallback_is_the_figure_at_default_settings(tiny):
    model, tok = tiny
    fig = sampling_playground(model, tok, "the ", static=True, n_samples=1, length=5)
    _, model_p, drawn = bars(fig)
    np.testing.assert_allclose(model_p, drawn, rtol=1e-6)  # temperature 1, nothing filtered
    assert len(fig.axes) == 2
