"""The causal leakage probe on the decoder-only model: both flavours pass it, and the same model
with its causal mask replaced (a full mask, a prefix-LM mask) is caught where it leaks."""

import dataclasses

import pytest
import torch

from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.masks import prefix_lm_mask
from tutorial_lib.probes import causal_leakage

FLAVOURS = {
    "gpt": dataclasses.replace(GPT_TINY, vocab_size=40, d_model=32, n_layers=2, max_len=16),
    "llama": dataclasses.replace(LLAMA_TINY, vocab_size=40, d_model=32, n_layers=2, d_ff=64, max_len=16),
}


@pytest.fixture(params=list(FLAVOURS))
def model(request):
    torch.manual_seed(0)
    return DecoderOnlyLM(FLAVOURS[request.param]).eval()


def test_both_flavours_pass_the_causal_leakage_probe(model):
    ids = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))
    report = causal_leakage(model, ids, vocab_size=40)
    assert report.passed, str(report)
    assert report.max_difference < 1e-5


def test_the_probe_catches_a_model_that_sees_the_future(model):
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(2))
    everything = torch.ones(10, 10, dtype=torch.bool)
    report = causal_leakage(lambda x: model(x, mask=everything), ids, vocab_size=40)
    assert not report.passed and report.first_offending_position == 0


def test_a_prefix_lm_leaks_inside_the_prefix_only(model):
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(3))
    prefix = prefix_lm_mask(4, 10)
    report = causal_leakage(lambda x: model(x, mask=prefix), ids, vocab_size=40)
    assert not report.passed and report.first_offending_position == 0
    # positions 0..3 see the whole prefix; from position 3 on nothing later is visible
    assert (report.per_position[:3] > 1e-5).all() and (report.per_position[3:] <= 1e-5).all()
