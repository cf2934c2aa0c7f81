"""The leakage and padding probes: they flag the models that are wrong, pass the ones that are
right, and say where the problem starts."""

import pytest
import torch
from torch import nn

from tutorial_lib.attention import MultiHeadAttention
from tutorial_lib.config import ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.masks import causal_mask, padding_mask
from tutorial_lib.probes import ProbeReport, causal_leakage, padding_isolation

V, D, T = 11, 16, 7


class TinyAttentionModel(nn.Module):
    """Embedding + positions + one attention layer + a head; the mask is chosen per call."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D))
        self.attn = MultiHeadAttention(D, 2)
        self.head = nn.Linear(D, V)

    def forward(self, ids, mask=None):
        x = self.embed(ids) + self.pos[: ids.size(1)]
        return self.head(x + self.attn(x, mask=mask).out)  # (B, T, V)


def ids_batch(B=3, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model():
    return TinyAttentionModel().eval()


def test_causal_model_passes_the_leakage_probe(model):
    report = causal_leakage(lambda ids: model(ids, causal_mask(ids.size(1))), ids_batch())
    assert isinstance(report, ProbeReport)
    assert report.passed and report.first_offending_position is None
    assert report.max_difference <= 1e-5
    assert report.per_position.shape == (T,)


def test_unmasked_model_fails_the_leakage_probe_from_position_zero(model):
    report = causal_leakage(model, ids_batch())
    assert not report.passed
    assert report.first_offending_position == 0
    assert report.max_difference > 1e-3
    assert (report.per_position[:-1] > 1e-3).all()  # every position but the last sees the future
    assert report.per_position[-1] == 0             # nothing comes after the last position
    assert "FAILED at position 0" in str(report)


def test_a_model_that_peeks_one_step_ahead_is_caught_at_every_position(model):
    one_ahead = torch.ones(T, T, dtype=torch.bool).tril(diagonal=1)   # off-by-one causal mask
    report = causal_leakage(lambda ids: model(ids, one_ahead), ids_batch())
    assert not report.passed and report.first_offending_position == 0
    assert (report.per_position[:-1] > 1e-3).all()


def test_a_model_that_leaks_only_late_is_located(model):
    late_leak = causal_mask(T).clone()
    late_leak[4, 6] = True                                           # position 4 sees position 6
    report = causal_leakage(lambda ids: model(ids, late_leak), ids_batch())
    assert report.first_offending_position == 4
    assert (report.per_position[:4] == 0).all() and report.per_position[4] > 1e-3
    only_early_cuts = causal_leakage(lambda ids: model(ids, late_leak), ids_batch(), positions=[0, 1, 2])
    assert only_early_cuts.passed  # the probe checks only the cuts it is given


def test_leakage_probe_accepts_a_decoder_only_lm_and_its_named_tuple_output():
    torch.manual_seed(0)
    lm = DecoderOnlyLM(ModelConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, max_len=T)).eval()
    assert causal_leakage(lm, ids_batch()).passed
    everything = torch.ones(T, T, dtype=torch.bool)
    assert not causal_leakage(lambda ids: lm(ids, mask=everything), ids_batch()).passed


def test_padding_isolation_passes_with_a_key_padding_mask_and_fails_without(model):
    ids = ids_batch()
    lengths = torch.tensor([7, 5, 3])
    pads = ~padding_mask(lengths, T)[:, 0, 0, :]                     # (B, T), True = padding
    keep = padding_mask(lengths, T)                                  # fixed: not rebuilt from ids
    good = padding_isolation(lambda x: model(x, keep), ids, pads)
    assert good.passed and good.max_difference <= 1e-5
    bad = padding_isolation(model, ids, pads)
    assert not bad.passed and bad.first_offending_position == 0
    assert (bad.per_position[:3] > 1e-3).all()                      # every example's real tokens


def test_padding_isolation_ignores_changes_at_the_padding_positions_themselves(model):
    # With a padding mask the padded positions' own outputs do change (their tokens changed);
    # that is not a failure.
    ids, lengths = ids_batch(), torch.tensor([7, 5, 3])
    pads = ~padding_mask(lengths, T)[:, 0, 0, :]
    keep = padding_mask(lengths, T)
    report = padding_isolation(lambda x: model(x, keep), ids, pads, trials=1)
    changed = model(torch.where(pads, (ids + 1) % V, ids), keep)
    assert (changed - model(ids, keep))[pads].abs().max() > 1e-3
    assert report.passed


def test_probes_refuse_a_model_in_training_mode_with_dropout():
    noisy = nn.Sequential(nn.Embedding(V, D), nn.Dropout(0.5)).train()
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        causal_leakage(noisy, ids_batch())


@pytest.mark.parametrize("bad, message", [
    (lambda m: causal_leakage(m, torch.rand(2, T)), "ids must hold integer token ids, got dtype torch.float32"),
    (lambda m: causal_leakage(m, torch.zeros(2, 1, dtype=torch.long)), "at least 2 positions"),
    (lambda m: causal_leakage(m, ids_batch(), vocab_size=5), r"ids must hold ids in \[0, 4\] \(size 5\)"),
    (lambda m: causal_leakage(m, ids_batch(), positions=[T - 1]),
     rf"positions\[0\] must be an int in \[0, T-1={T - 1}\) \(something must come after them\), got {T - 1}"),
    (lambda m: causal_leakage(lambda ids: m(ids)[:, 0], ids_batch()), r"outputs \(B, T, ...\)"),
    (lambda m: padding_isolation(m, ids_batch(), torch.zeros(3, T)), "pad_positions must be a boolean"),
    (lambda m: padding_isolation(m, ids_batch(), torch.zeros(3, T, dtype=torch.bool)), "no padding"),
    (lambda m: padding_isolation(m, ids_batch(), torch.ones(3, T, dtype=torch.bool), trials=0), "trials"),
])
def test_probes_reject_bad_input(model, bad, message):
    with pytest.raises(ValueError, match=message):
        bad(model)
