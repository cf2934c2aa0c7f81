"""T5's relative-position bias (positions="relative"): the buckets and the bias against
Hugging Face's T5 (built from a tiny T5Config, never downloaded, weights copied), whole
encoder and decoder stacks against T5's, the KV cache, gradients, and the parameter count.

T5 does not divide its scores by sqrt(d_k) (the factor is folded into its initialisation);
tutorial_lib's attention does. Copying T5's W_Q multiplied by sqrt(d_k) gives identical
scores, q k^T / sqrt(d_k) = (sqrt(d_k) q) k^T / sqrt(d_k) ... = T5's q k^T, which is how the
stack comparisons below copy the weights (and one test shows that a plain copy differs).
"""

import dataclasses
import math

import pytest
import torch

from tutorial_lib.config import T5_SMALL, ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.params import count_parameters, expected_parameters, unique_parameter_count
from tutorial_lib.positions import RelativePositionBias, relative_position_bucket
from tutorial_lib.transformer import Decoder, DecoderCache, Encoder, EncoderDecoder

transformers = pytest.importorskip("transformers")
from transformers.models.t5.modeling_t5 import T5Attention  # noqa: E402

D_MODEL, HEADS, D_KV, BUCKETS, MAX_DISTANCE = 32, 4, 8, 16, 40


def tiny_t5():
    torch.manual_seed(0)
    hf_cfg = transformers.T5Config(vocab_size=40, d_model=D_MODEL, d_kv=D_KV, num_heads=HEADS, d_ff=64,
                                   num_layers=2, num_decoder_layers=2, relative_attention_num_buckets=BUCKETS,
                                   relative_attention_max_distance=MAX_DISTANCE, dropout_rate=0.0,
                                   feed_forward_proj="relu")
    return transformers.T5Model(hf_cfg).eval()


def ours_config(**changes):
    fields = dict(family="encoder-decoder", vocab_size=40, d_model=D_MODEL, n_layers=2, n_heads=HEADS, head_dim=D_KV,
                  d_ff=64, norm="rmsnorm", norm_eps=1e-6, ffn="relu", positions="relative",
                  relative_buckets=BUCKETS, relative_max_distance=MAX_DISTANCE, bias=False)
    return ModelConfig(**(fields | changes))


def copy_attention(ours, theirs, fold_scale=True):
    """T5's q, k, v, o into our fused [Q; K; V] and out; W_Q times sqrt(d_k) (see the module docstring)."""
    scale = math.sqrt(theirs.key_value_proj_dim) if fold_scale else 1.0
    ours.qkv.weight.copy_(torch.cat([theirs.q.weight * scale, theirs.k.weight, theirs.v.weight]))
    ours.out.weight.copy_(theirs.o.weight)


@torch.no_grad()
def copy_encoder(ours, t5_stack, fold_scale=True):
    for layer, block in zip(ours.layers, t5_stack.block, strict=True):
        copy_attention(layer.attn, block.layer[0].SelfAttention, fold_scale)
        layer.attn_sublayer.norm.weight.copy_(block.layer[0].layer_norm.weight)
        layer.ffn.up.weight.copy_(block.layer[1].DenseReluDense.wi.weight)
        layer.ffn.down.weight.copy_(block.layer[1].DenseReluDense.wo.weight)
        layer.ffn_sublayer.norm.weight.copy_(block.layer[1].layer_norm.weight)
    ours.final_norm.weight.copy_(t5_stack.final_layer_norm.weight)
    ours.relative_bias.table.weight.copy_(t5_stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight)


@torch.no_grad()
def copy_decoder(ours, t5_stack):
    for layer, block in zip(ours.layers, t5_stack.block, strict=True):
        copy_attention(layer.self_attn, block.layer[0].SelfAttention)
        copy_attention(layer.cross_attn, block.layer[1].EncDecAttention)
        layer.self_sublayer.norm.weight.copy_(block.layer[0].layer_norm.weight)
        layer.cross_sublayer.norm.weight.copy_(block.layer[1].layer_norm.weight)
        layer.ffn.up.weight.copy_(block.layer[2].DenseReluDense.wi.weight)
        layer.ffn.down.weight.copy_(block.layer[2].DenseReluDense.wo.weight)
        layer.ffn_sublayer.norm.weight.copy_(block.layer[2].layer_norm.weight)
    ours.final_norm.weight.copy_(t5_stack.final_layer_norm.weight)
    ours.relative_bias.table.weight.copy_(t5_stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight)


# ---- the bucket function ------------------------------------------------------------------------

@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("n_buckets, max_distance", [(32, 128), (16, 40), (8, 20), (4, 8), (64, 512), (9, 50)])
def test_buckets_equal_t5s_for_every_relative_position(bidirectional, n_buckets, max_distance):
    relative = torch.arange(-1000, 1001)
    ours = relative_position_bucket(relative, bidirectional=bidirectional, n_buckets=n_buckets,
                                    max_distance=max_distance)
    theirs = T5Attention._relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=n_buckets,
                                                   max_distance=max_distance)
    assert torch.equal(ours, theirs), f"buckets differ at relative positions {relative[ours != theirs].tolist()}"


def test_buckets_are_exact_near_the_query_logarithmic_further_and_capped():
    relative = torch.arange(-200, 201)  # key position - query position
    causal = relative_position_bucket(relative, bidirectional=False, n_buckets=32, max_distance=128)
    back = -relative[relative <= 0].flip(0)  # distances 0, 1, 2, ... back
    back_buckets = causal[relative <= 0].flip(0)
    assert torch.equal(back_buckets[:16], back[:16]), "distances 0..15 back must have a bucket each"
    assert (back_buckets.diff() >= 0).all(), "buckets must not decrease with distance"
    assert (back_buckets[128:] == 31).all(), "every distance from max_distance on shares the last bucket"
    # in between, bucket 16 + floor(16 * log(d / 16) / log(128 / 16)): 16 shared buckets, log-spaced
    for d in range(16, 128):
        expected = min(31, 16 + math.floor(16 * math.log(d / 16) / math.log(8)))
        assert back_buckets[d] == expected, f"distance {d}: bucket {back_buckets[d]}, expected {expected}"
    assert (causal[relative > 0] == 0).all(), "causal: keys after the query share bucket 0"
    both = relative_position_bucket(relative, bidirectional=True, n_buckets=32, max_distance=128)
    assert torch.equal(both[relative <= 0].flip(0)[:8], torch.arange(8)), "bidirectional: 8 exact buckets back"
    assert torch.equal(both[relative > 0][:7], 16 + torch.arange(1, 8)), "keys ahead use buckets 16.."
    assert both.max() == 31 and (both[relative <= 0] < 16).all(), "keys behind use buckets 0..15"


def test_bad_bucket_sizes_and_inputs_are_refused():
    with pytest.raises(ValueError, match="n_buckets must be at least 4"):
        RelativePositionBias(2, 3, 10, bidirectional=True)
    with pytest.raises(ValueError, match="max_distance must exceed the 8 exact buckets"):
        RelativePositionBias(2, 16, 8, bidirectional=False)
    with pytest.raises(ValueError, match="integer tensor"):
        relative_position_bucket(torch.zeros(3), bidirectional=True)
    with pytest.raises(ValueError, match="T <= S"):
        RelativePositionBias(2, bidirectional=True)(5, 3)
    with pytest.raises(ValueError, match=r"n_heads must be a positive int \(an int >= 1\)"):
        RelativePositionBias(0, bidirectional=True)


# ---- the bias tensor ------------------------------------------------------------------------------

@pytest.mark.parametrize("bidirectional", [True, False])
def test_bias_equals_t5s_compute_bias_including_queries_at_an_offset(bidirectional):
    t5 = tiny_t5()
    stack = t5.encoder if bidirectional else t5.decoder
    attn = stack.block[0].layer[0].SelfAttention
    ours = RelativePositionBias(HEADS, BUCKETS, MAX_DISTANCE, bidirectional=bidirectional)
    with torch.no_grad():
        ours.table.weight.copy_(attn.relative_attention_bias.weight)
    for T, S in ((60, 60), (1, 45), (3, 50)):  # full, one cached decoding step, three new tokens
        theirs = attn.compute_bias(T, S, past_seen_tokens=S - T)  # (1, h, T, S)
        torch.testing.assert_close(ours(T, S)[None], theirs, atol=0, rtol=0)


# ---- whole stacks against T5's -------------------------------------------------------------------

def test_encoder_stack_equals_t5s_encoder_with_and_without_padding():
    t5 = tiny_t5()
    encoder = Encoder(ours_config()).eval()
    copy_encoder(encoder, t5.encoder)
    x = torch.randn(2, 50, D_MODEL)  # longer than MAX_DISTANCE: the capped buckets are used
    keep = torch.ones(2, 50, dtype=torch.bool)
    keep[1, 41:] = False
    with torch.no_grad():
        for mask, hf_mask in ((None, None), (keep[:, None, None, :], keep.long())):
            ours = encoder(x, mask).x
            theirs = t5.encoder(inputs_embeds=x, attention_mask=hf_mask).last_hidden_state
            real = keep[..., None] if mask is not None else torch.ones(1, 1, 1, dtype=torch.bool)
            torch.testing.assert_close(ours * real, theirs * real, atol=2e-5, rtol=1e-4)


def test_without_folding_sqrt_dk_into_w_q_the_stacks_differ():
    t5 = tiny_t5()
    encoder = Encoder(ours_config()).eval()
    copy_encoder(encoder, t5.encoder, fold_scale=False)
    x = torch.randn(2, 20, D_MODEL)
    with torch.no_grad():
        gap = (encoder(x).x - t5.encoder(inputs_embeds=x).last_hidden_state).abs().max()
    assert gap > 1e-2, f"scores scaled by 1/sqrt(d_k) should change the output, gap {gap:.2e}"


def test_decoder_stack_equals_t5s_decoder_causal_bias_and_no_bias_in_cross_attention():
    t5 = tiny_t5()
    decoder = Decoder(ours_config()).eval()
    copy_decoder(decoder, t5.decoder)
    y, memory = torch.randn(2, 45, D_MODEL), torch.randn(2, 13, D_MODEL)
    with torch.no_grad():
        ours = decoder(y, memory).x
        theirs = t5.decoder(inputs_embeds=y, encoder_hidden_states=memory).last_hidden_state
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        # cached decoding: the new queries sit at offsets 0..44 and get their buckets from there
        cache = DecoderCache(len(decoder.layers))
        steps = [decoder(y[:, :30], memory, cache=cache).x]
        steps += [decoder(y[:, t: t + 1], memory, cache=cache).x for t in range(30, 45)]
        torch.testing.assert_close(torch.cat(steps, dim=1), theirs, atol=2e-5, rtol=1e-4)


# ---- decoder-only model with the KV cache, gradients, both attention paths ---------------------------

def test_decoder_only_model_with_t5_bias_decodes_with_a_cache_as_without_and_never_looks_ahead():
    cfg = ModelConfig(family="decoder", vocab_size=30, d_model=32, n_layers=2, n_heads=4, max_len=64,
                      positions="relative", relative_buckets=8, relative_max_distance=16)
    torch.manual_seed(1)
    model = DecoderOnlyLM(cfg).eval()
    with torch.no_grad():
        model.relative_bias.table.weight.normal_(0.0, 1.0)  # a bias large enough to matter
        ids = torch.randint(0, 30, (2, 40))
        full = model(ids).logits
        cache = model.new_cache()
        pieces = [model(ids[:, :25], cache=cache).logits]
        pieces += [model(ids[:, t: t + 1], cache=cache).logits for t in range(25, 40)]
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
        written_out = model(ids, need_weights=True).logits
        torch.testing.assert_close(written_out, full, atol=1e-5, rtol=1e-5)
        changed = ids.clone()
        changed[:, 30:] = (changed[:, 30:] + 1) % 30
        assert torch.equal(model(changed).logits[:, :30], full[:, :30]), "a later token changed earlier logits"
        no_bias = model.relative_bias.table.weight.clone()
        model.relative_bias.table.weight.zero_()
        assert (model(ids).logits - full).abs().max() > 1e-3, "the bias table should change the logits"
        model.relative_bias.table.weight.copy_(no_bias)


@pytest.mark.parametrize("need_weights", [False, True])
def test_the_table_gets_the_same_gradient_on_the_fused_and_the_written_out_path(need_weights):
    cfg = ModelConfig(family="decoder", vocab_size=30, d_model=32, n_layers=2, n_heads=4, max_len=32,
                      positions="relative", relative_buckets=8, relative_max_distance=16)
    torch.manual_seed(2)
    model = DecoderOnlyLM(cfg)
    ids = torch.randint(0, 30, (3, 20))
    model(ids, ids, need_weights=need_weights).loss.backward()
    grad = model.relative_bias.table.weight.grad
    assert grad is not None and grad.abs().sum() > 0, "the bias table must be trained"
    torch.manual_seed(2)
    other = DecoderOnlyLM(cfg)
    other(ids, ids, need_weights=not need_weights).loss.backward()
    torch.testing.assert_close(grad, other.relative_bias.table.weight.grad, atol=1e-6, rtol=1e-4)


# ---- parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["encoder-decoder", "decoder", "encoder"])
def test_one_table_per_self_attention_stack_counted_as_tutorial_lib_params_expects(family):
    from tutorial_lib.encoder_only import EncoderBackbone

    changes = {"family": family}
    if family == "decoder":
        changes |= {"positions": "relative"}
    cfg = ours_config(**changes) if family == "encoder-decoder" else ModelConfig(
        family=family, vocab_size=40, d_model=D_MODEL, n_layers=3, n_heads=HEADS, positions="relative",
        relative_buckets=BUCKETS, relative_max_distance=MAX_DISTANCE)
    build = {"encoder-decoder": EncoderDecoder, "decoder": DecoderOnlyLM, "encoder": EncoderBackbone}[family]
    model = build(cfg)
    measured = count_parameters(model)
    assert measured == expected_parameters(cfg)
    assert measured["total"] == unique_parameter_count(model)
    stacks = ["encoder", "decoder"] if family == "encoder-decoder" else [family]
    for stack in stacks:
        assert measured[f"{stack}.position_bias"] == BUCKETS * HEADS, f"one {BUCKETS} x {HEADS} table in the {stack}"


def test_t5_small_builds_with_the_parameter_count_of_the_published_model():
    with torch.device("meta"):
        model = EncoderDecoder(T5_SMALL)
    counts = count_parameters(model)
    assert counts == expected_parameters(T5_SMALL)
    # T5ForConditionalGeneration "t5-small": 60,506,624 parameters with its tied head
    assert counts["total"] == 60_506_624
    assert counts["encoder.position_bias"] == counts["decoder.position_bias"] == 32 * 8
    wider = dataclasses.replace(T5_SMALL, relative_buckets=64)
    assert expected_parameters(wider)["total"] - counts["total"] == 2 * 32 * 8
