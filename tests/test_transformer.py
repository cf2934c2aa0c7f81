"""The encoder-decoder model against nn.Transformer, and the properties its masks promise."""

import pytest
import torch
from torch import nn

from tutorial_lib.config import ModelConfig
from tutorial_lib.convert import copy_from_torch_transformer
from tutorial_lib.masks import causal_mask, key_padding_to_torch, to_blocked
from tutorial_lib.transformer import EncoderDecoder, seq2seq_masks

ATOL = 1e-5


def cfg(order="pre", **changes):
    base = dict(family="encoder-decoder", vocab_size=13, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                max_len=32, norm_order=order, ffn="relu", positions="sinusoidal")
    return ModelConfig(**(base | changes))


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # PyTorch's note on its own fast path
@pytest.mark.parametrize("order", ["post", "pre"])
def test_stacks_equal_nn_transformer_with_padding_and_causal_masks(order):
    ours = EncoderDecoder(cfg(order, final_norm=True)).eval()
    theirs = nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, activation="relu", batch_first=True,
                            norm_first=order == "pre").eval()
    copy_from_torch_transformer(ours, theirs)
    B, S, T = 3, 7, 5
    src, tgt = torch.randn(B, S, 32), torch.randn(B, T, 32)
    src_keep = torch.arange(S) < torch.tensor([7, 4, 6])[:, None]
    tgt_keep = torch.arange(T) < torch.tensor([5, 5, 3])[:, None]
    src_mask, tgt_mask = seq2seq_masks(src_keep, tgt_keep)
    memory = ours.encoder(src, src_mask).x
    got = ours.decoder(tgt, memory, tgt_mask, src_mask).x
    expected = theirs(src, tgt, tgt_mask=to_blocked(causal_mask(T)),
                      src_key_padding_mask=key_padding_to_torch(src_mask),
                      tgt_key_padding_mask=~tgt_keep, memory_key_padding_mask=key_padding_to_torch(src_mask))
    torch.testing.assert_close(got[tgt_keep], expected[tgt_keep], atol=ATOL, rtol=0)


def model_and_batch(**changes):
    torch.manual_seed(0)
    model = EncoderDecoder(cfg(**changes)).eval()
    src = torch.randint(3, 13, (2, 6))
    tgt = torch.randint(3, 13, (2, 5))
    return model, src, tgt


def test_changing_a_future_target_token_leaves_earlier_outputs_unchanged():
    model, src, tgt = model_and_batch()
    before = model(src, tgt).logits
    changed = tgt.clone()
    changed[:, 3] = (changed[:, 3] + 1) % 13
    after = model(src, changed).logits
    torch.testing.assert_close(after[:, :3], before[:, :3], atol=ATOL, rtol=0)
    assert not torch.allclose(after[:, 3:], before[:, 3:], atol=1e-3)


def test_changing_a_padded_source_token_leaves_every_output_unchanged():
    model, src, tgt = model_and_batch()
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    src_mask, _ = seq2seq_masks(keep, torch.ones_like(tgt, dtype=torch.bool))
    before = model(src, tgt, src_mask=src_mask).logits
    changed = src.clone()
    changed[1, 4:] = torch.tensor([5, 9])
    torch.testing.assert_close(model(src, tgt, src_mask=src_mask).logits, before)
    torch.testing.assert_close(model(changed, tgt, src_mask=src_mask).logits, before, atol=ATOL, rtol=0)
    changed[1, 2] = (changed[1, 2] + 1) % 13  # a real source token does matter
    assert not torch.allclose(model(changed, tgt, src_mask=src_mask).logits[1], before[1], atol=1e-4)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope"])
def test_cached_decoding_equals_full_teacher_forced_pass(positions):
    model, src, tgt = model_and_batch(positions=positions)
    full = model(src, tgt).logits
    memory = model.encode(src).x
    cache = model.new_cache()
    steps = [model.head(model.decode(tgt[:, t : t + 1], memory, cache=cache).x) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    layer_cache = cache.cross[0]
    assert len(layer_cache) == src.size(1), "cross-attention keys were cached once, for every source position"


def test_frontend_for_continuous_inputs_gives_logits_per_target_token():
    config = cfg(vocab_size=26, max_len=128)
    model = EncoderDecoder(config, frontend=nn.Linear(80, 32))
    frames = torch.randn(16, 100, 80)
    lengths = torch.randint(40, 101, (16,))
    src_mask = (torch.arange(100) < lengths[:, None])[:, None, None, :]
    tgt = torch.randint(0, 26, (16, 50))
    out = model(frames, tgt, tgt, src_mask=src_mask)
    assert out.logits.shape == (16, 50, 26)
    assert torch.isfinite(out.loss)
    assert not hasattr(model.src_embed.tokens, "weight"), "no source token table with a frontend"


def test_shared_and_tied_embeddings_are_one_matrix():
    model = EncoderDecoder(cfg(share_embeddings=True, tie_embeddings=True))
    assert model.src_embed.tokens.weight is model.tgt_embed.tokens.weight is model.head.weight
    untied = EncoderDecoder(cfg(tie_embeddings=False, src_vocab_size=20))
    assert untied.head.weight is not untied.tgt_embed.tokens.weight
    assert untied.src_embed.tokens.num_embeddings == 20


def test_bad_configs_and_inputs_raise():
    with pytest.raises(ValueError, match="family='encoder-decoder'"):
        EncoderDecoder(ModelConfig(family="decoder"))
    model, src, tgt = model_and_batch()
    with pytest.raises(ValueError, match="targets must have the shape"):
        model(src, tgt, tgt[:, :-1])
    with pytest.raises(ValueError, match=r"tgt_in must hold ids in \[0, 12\] \(size 13\); it holds \[23, 26"):
        model(src, tgt + 20)


def test_the_stacks_check_their_inputs_before_computing():
    model, src, tgt = model_and_batch()
    memory = model.encode(src).x  # (2, 6, 32)
    with pytest.raises(ValueError, match=r"x must be float vectors of shape \(B, T, d_model=32\), got list"):
        model.encoder([[0.0] * 32])
    with pytest.raises(ValueError, match=r"x must be float vectors .* got torch.int64 \(2, 6\)"):
        model.encoder(src)
    with pytest.raises(ValueError, match=r"memory must be float vectors .*d_model=32\), got torch.float32 \(2, 6, 8\)"):
        model.decoder(torch.randn(2, 5, 32), memory[..., :8])


def test_forward_reads_every_id_and_target_on_the_host_once(id_value_checks):
    import tutorial_lib.layers
    import tutorial_lib.transformer

    calls = id_value_checks(tutorial_lib.transformer, tutorial_lib.layers)
    model, src, tgt = model_and_batch()
    model(src, tgt, tgt)
    assert calls == [["src", "tgt_in", "targets"]], f"expected one check of all three, got {calls}"
