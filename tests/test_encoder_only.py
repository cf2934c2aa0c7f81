"""Encoder-only models: MLM corruption and loss, pooling, the classifier, the continuous frontend."""

import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib.config import ModelConfig
from tutorial_lib.encoder_only import (
    IGNORE_INDEX,
    EncoderBackbone,
    MaskedLM,
    SequenceClassifier,
    keep_from_lengths,
    mask_tokens,
    mean_pool,
)
from tutorial_lib.train import make_optimizer, train

PAD, CLS, MASK = 0, 1, 2
SPECIALS = (PAD, CLS)
V = 40
CFG = ModelConfig(family="encoder", vocab_size=V, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=32)


def corpus_batch(B=200, T=500, seed=0):
    """Ids with a [CLS] first and right padding of random length, like a real MLM batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(MASK + 1, V, (B, T), generator=g)
    ids[:, 0] = CLS
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    ids[torch.arange(T) >= lengths[:, None]] = PAD
    return ids


def test_mask_tokens_makes_the_15_and_80_10_10_split_within_four_standard_errors():
    ids = corpus_batch()
    batch = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS,
                        generator=torch.Generator().manual_seed(1))
    eligible = ~torch.isin(ids, torch.tensor(SPECIALS))
    n_eligible, n_selected = int(eligible.sum()), int(batch.selected.sum())

    def close(count, n, p):
        """count successes of n draws against probability p: within 4 binomial standard errors."""
        se = math.sqrt(p * (1 - p) / n)
        assert abs(count / n - p) < 4 * se, f"{count}/{n} = {count / n:.4f}, expected {p} +- {4 * se:.4f}"

    close(n_selected, n_eligible, 0.15)
    chosen_in, chosen_orig = batch.inputs[batch.selected], ids[batch.selected]
    K = V - 3  # ordinary ids a random replacement is drawn from
    close(int((chosen_in == MASK).sum()), n_selected, 0.8)
    close(int(((chosen_in != MASK) & (chosen_in != chosen_orig)).sum()), n_selected, 0.1 * (1 - 1 / K))
    close(int((chosen_in == chosen_orig).sum()), n_selected, 0.1 + 0.1 / K)


def test_mask_tokens_never_touches_padding_specials_or_unselected_positions():
    ids = corpus_batch(B=50, T=100)
    batch = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS,
                        generator=torch.Generator().manual_seed(2))
    special = torch.isin(ids, torch.tensor(SPECIALS))
    assert not (batch.selected & special).any(), "padding and [CLS] must never be selected"
    assert torch.equal(batch.inputs[~batch.selected], ids[~batch.selected]), "unselected positions stay"
    assert torch.equal(batch.labels[batch.selected], ids[batch.selected])
    assert (batch.labels[~batch.selected] == IGNORE_INDEX).all()
    replaced = batch.inputs[batch.selected]
    assert not torch.isin(replaced, torch.tensor(SPECIALS)).any(), "random replacements are never special"
    again = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS,
                        generator=torch.Generator().manual_seed(2))
    assert torch.equal(again.inputs, batch.inputs), "the same generator seed gives the same batch"


def test_mask_tokens_validates_its_arguments():
    ids = corpus_batch(B=2, T=8)
    with pytest.raises(ValueError, match="integer tensor of shape"):
        mask_tokens(ids.float(), mask_id=MASK, vocab_size=V)
    with pytest.raises(ValueError, match="mask_prob \\+ random_prob"):
        mask_tokens(ids, mask_id=MASK, vocab_size=V, mask_prob=0.95, random_prob=0.1)
    with pytest.raises(ValueError, match="select_prob must lie"):
        mask_tokens(ids, mask_id=MASK, vocab_size=V, select_prob=1.5)
    with pytest.raises(ValueError, match="must lie in \\[0, vocab_size"):
        mask_tokens(ids, mask_id=V, vocab_size=V)
    with pytest.raises(ValueError, match="every id is special"):
        mask_tokens(torch.zeros(1, 3, dtype=torch.long), mask_id=1, vocab_size=2, special_ids=[0])


def test_mlm_loss_is_cross_entropy_at_the_selected_positions_only():
    torch.manual_seed(0)
    model = MaskedLM(CFG, pad_id=PAD).eval()
    ids = corpus_batch(B=3, T=20, seed=3)
    batch = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, select_prob=0.3,
                        generator=torch.Generator().manual_seed(3))
    out = model(batch.inputs, batch.labels)
    sel = batch.selected
    expected = F.cross_entropy(out.logits[sel], ids[sel])
    torch.testing.assert_close(out.loss, expected)

    logits = out.logits.detach().requires_grad_()
    F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX).backward()
    assert logits.grad[~sel].abs().max() == 0, "unselected positions must not feed the loss"
    assert logits.grad[sel].abs().max() > 0
    assert model.head.decoder.weight is model.backbone.embed.tokens.weight, "tied embeddings"
    with pytest.raises(ValueError, match="every value of labels equals ignore_index=-100"):
        model(ids, torch.full_like(ids, IGNORE_INDEX))


def test_mean_pool_ignores_padding_exactly_even_nan():
    x = torch.randn(3, 6, 4)
    lengths = torch.tensor([6, 2, 4])
    keep = keep_from_lengths(lengths, 6)
    poisoned = x.clone()
    poisoned[~keep] = float("nan")
    poisoned[1, 5] = float("inf")
    pooled = mean_pool(poisoned, keep)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(pooled[b], x[b, :n].mean(0))
    assert torch.equal(pooled, mean_pool(x, keep)), "padding must not change the mean in any bit"
    with pytest.raises(ValueError, match="no real position"):
        mean_pool(x, torch.zeros(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="lengths must lie in"):
        keep_from_lengths(torch.tensor([0, 3]), 6)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_ignores_padding_and_reads_the_right_vector(pooling):
    torch.manual_seed(0)
    model = SequenceClassifier(CFG, 3, pooling=pooling, pad_id=PAD).eval()
    short = torch.tensor([[CLS, 5, 9, 7]])
    padded = torch.tensor([[CLS, 5, 9, 7, PAD, PAD, PAD], [CLS, 8, 8, 3, 4, 6, 5]])
    alone = model(short).logits[0]
    together = model(padded).logits[0]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    by_lengths = model(padded, lengths=torch.tensor([4, 7])).logits
    torch.testing.assert_close(by_lengths[0], alone, atol=1e-5, rtol=0)

    encoded = model.backbone(padded)
    pooled = encoded.x[:, 0] if pooling == "cls" else encoded.x[:, :4].mean(1)
    torch.testing.assert_close(model.classifier(pooled)[0], together, atol=1e-6, rtol=0)


def test_frontend_takes_feature_frames_with_per_example_lengths():
    torch.manual_seed(0)
    model = SequenceClassifier(CFG, 2, pooling="mean", n_features=80).eval()
    frames = torch.randn(3, 10, 80)
    lengths = torch.tensor([10, 6, 3])
    out = model(frames, lengths=lengths)
    assert out.logits.shape == (3, 2)
    noisy = frames.clone()
    noisy[1, 6:] = 1e4 * torch.randn(4, 80)  # padding frames may hold anything
    noisy[2, 3:] = 0.0
    torch.testing.assert_close(model(noisy, lengths=lengths).logits, out.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(model(frames[1:2, :6]).logits[0], out.logits[1], atol=1e-5, rtol=0)
    weights = model(frames, lengths=lengths, need_weights=True).attn  # (L, B, h, T, S)
    assert weights.shape == (2, 3, 4, 10, 10) and (weights[:, 2, :, :, 3:] == 0).all()


def test_frontend_and_classifier_validate_inputs():
    model = SequenceClassifier(CFG, 2, pooling="mean", n_features=80)
    with pytest.raises(ValueError, match="float feature frames"):
        model(torch.randn(2, 5, 40))
    with pytest.raises(ValueError, match="lengths must have shape"):
        model(torch.randn(2, 5, 80), lengths=torch.tensor([5]))
    with pytest.raises(ValueError, match="no \\[CLS\\] token"):
        SequenceClassifier(CFG, 2, pooling="cls", n_features=80)
    with pytest.raises(ValueError, match="pooling must be one of"):
        SequenceClassifier(CFG, 2, pooling="max")
    with pytest.raises(ValueError, match="family='encoder'"):
        EncoderBackbone(ModelConfig(family="decoder"))
    with pytest.raises(ValueError, match="ids must hold ids in \\[0, 39\\] \\(size 40\\); it holds \\[40\\]"):
        MaskedLM(CFG)(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="nothing but padding"):
        SequenceClassifier(CFG, 2, pad_id=PAD)(torch.tensor([[PAD, PAD]]))


def test_each_model_reads_ids_and_labels_on_the_host_once_and_the_backbone_can_skip_it(id_value_checks):
    import tutorial_lib.encoder_only
    import tutorial_lib.layers

    calls = id_value_checks(tutorial_lib.encoder_only, tutorial_lib.layers)
    torch.manual_seed(0)
    ids = torch.randint(MASK + 1, V, (2, 6))
    MaskedLM(CFG)(ids, ids)
    SequenceClassifier(CFG, 3)(ids, torch.tensor([0, 2]))
    assert calls == [["ids", "labels"], ["inputs", "labels"]], calls
    backbone = EncoderBackbone(CFG)
    calls.clear()
    backbone(ids, check_ids=False)
    assert calls == [], "check_ids=False: the caller has checked the ids"
    backbone(ids)
    assert calls == [["ids"]]
    with pytest.raises(ValueError, match=r"ids must hold ids in \[0, 39\] \(size 40\); it holds \[40\]"):
        backbone(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="ids must hold integer token ids"):
        backbone(torch.zeros(1, 3))


def test_mean_pooled_classifier_learns_a_counting_task():
    """Label: does token 3 occur more often than token 4? Padding of random length included."""
    cfg = ModelConfig(family="encoder", vocab_size=8, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_len=12)

    def batch(i, B=64):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(3, 8, (B, 12), generator=g)
        lengths = torch.randint(4, 13, (B,), generator=g)
        ids[torch.arange(12) >= lengths[:, None]] = PAD
        labels = ((ids == 3).sum(1) > (ids == 4).sum(1)).long()
        return ids, labels

    torch.manual_seed(0)
    model = SequenceClassifier(cfg, 2, pooling="mean", pad_id=PAD)
    train(model, batch, 150, optimizer=make_optimizer(model, 3e-3), progress=False)
    ids, labels = batch(10_000, B=512)
    model.eval()
    with torch.no_grad():
        accuracy = (model(ids).logits.argmax(-1) == labels).float().mean().item()
    assert accuracy > 0.9, accuracy


@pytest.mark.parametrize("case", range(4))
def test_block_parameter_exercise_agrees_with_the_library(case):
    from tutorial_lib.exercises import EXERCISES
    from tutorial_lib.layers import TransformerBlock

    exercise = EXERCISES["04.block_parameters"]
    d, d_ff, ffn, attn_bias, ffn_bias, norm = exercise.cases()[case]
    cfg = ModelConfig(family="encoder", d_model=d, n_heads=4, d_ff=d_ff, ffn=ffn, norm=norm,
                      qkv_bias=attn_bias, out_bias=attn_bias, ffn_bias=ffn_bias, norm_bias=True)
    block = TransformerBlock(cfg)
    assert exercise.reference(d, d_ff, ffn, attn_bias, ffn_bias, norm) == sum(p.numel() for p in block.parameters())
