"""generate runs the model's own modules at every step by default, so hooks see every step;
``generate(..., fast=True)`` runs the one-token steps through FastDecoder, whose logits are the
modules' logits, bit for bit, for every kind of decoder-only block this package builds; a model
with hooks or parts it does not know gets no fast decoder, and fast=True then says why."""

import dataclasses
import re

import pytest
import torch
from torch import nn

from tutorial_lib.attention import MultiHeadAttention
from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.fast_decode import FastDecoder, fast_decoder, rms_norm_steps, why_not_fast
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.sampling import Sampler, generate

SMALL = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_len": 40}
GPT = dataclasses.replace(GPT_TINY, **SMALL)
LLAMA = dataclasses.replace(LLAMA_TINY, **SMALL, d_ff=48)

CONFIGS = {
    "gpt": GPT,
    "llama (GQA, RoPE, RMSNorm, SwiGLU)": LLAMA,
    "llama, one kv head": dataclasses.replace(LLAMA, n_kv_heads=1),
    "post-LN, sinusoidal, scaled embeddings": dataclasses.replace(
        GPT, norm_order="post", positions="sinusoidal", scale_embeddings=True, tie_embeddings=False),
    "ALiBi, no biases, GeGLU": dataclasses.replace(GPT, positions="alibi", bias=False, ffn="geglu"),
    "T5 relative bias, ReLU": dataclasses.replace(GPT, positions="relative", ffn="relu"),
    "mixture of experts, one dense layer": dataclasses.replace(LLAMA, n_experts=4, experts_per_token=2,
                                                               dense_layers=(0,)),
}


def model_of(cfg, seed: int = 0) -> DecoderOnlyLM:
    torch.manual_seed(seed)
    model = DecoderOnlyLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm scales and biases, so that a wrong one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def both_paths(model, prompt, n, sampler=None, seed=None):
    """generate's (ids, logits) with fast=True (FastDecoder), then by default (the modules); a
    sampling generator is made afresh from ``seed`` for each."""
    def run(fast):
        extra = {} if sampler is None else {"sampler": sampler, "generator": torch.Generator().manual_seed(seed)}
        return generate(model, prompt, n, return_logits=True, fast=fast, **extra)

    assert fast_decoder(model) is not None, "this model should get a fast decoder"
    return run(True), run(False)


def assert_same(fast, slow, what):
    assert torch.equal(fast[0], slow[0]), f"{what}: FastDecoder and the modules chose different tokens"
    assert torch.equal(fast[1], slow[1]), f"{what}: logits differ by {(fast[1] - slow[1]).abs().max():.2e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_steps_give_the_modules_logits_bit_for_bit(name):
    model = model_of(CONFIGS[name])
    decoder = fast_decoder(model)
    assert isinstance(decoder, FastDecoder), f"{name} should get a fast decoder"
    prompt = torch.randint(0, model.cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        slow_cache, fast_cache = model.new_cache(), model.new_cache()
        model(prompt, cache=slow_cache)
        model(prompt, cache=fast_cache)
        token = prompt[:, -1:]
        for _ in range(12):
            slow = model(token, cache=slow_cache).logits[:, -1]  # (B, V)
            fast = decoder(token, fast_cache)
            assert torch.equal(fast, slow), f"{name}: logits differ by {(fast - slow).abs().max():.2e}"
            token = torch.multinomial(slow.softmax(-1), 1)  # a varied next token: (B, 1)
        for slow_layer, fast_layer in zip(slow_cache.layers, fast_cache.layers):
            assert len(fast_layer) == len(slow_layer) == 17, "5 prompt positions and 12 steps cached"
            assert torch.equal(fast_layer.keys, slow_layer.keys), f"{name}: the cached keys differ"
            assert torch.equal(fast_layer.values, slow_layer.values), f"{name}: the cached values differ"


def test_bf16_weights_take_the_same_path_as_the_modules():
    model = model_of(LLAMA).to(torch.bfloat16)  # RMSNorm's non-float32 branch
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(2))
    assert_same(*both_paths(model, prompt, 10), "bf16 weights")


def test_generate_matches_recomputing_across_a_window_refill():
    model = model_of(LLAMA)
    prompt = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(3))
    sampler = Sampler(temperature=0.9, top_k=20)
    recomputed = generate(model, prompt, 25, sampler=sampler, generator=torch.Generator().manual_seed(4),
                          use_cache=False, return_logits=True)
    for fast in (True, False):  # 55 positions > max_len 40: the cache is refilled
        cached = generate(model, prompt, 25, sampler=sampler, generator=torch.Generator().manual_seed(4),
                          fast=fast, return_logits=True)
        assert torch.equal(cached[0], recomputed[0]), f"fast={fast}: cached and recomputed generation differ"
        torch.testing.assert_close(cached[1], recomputed[1], atol=1e-5, rtol=1e-5)


def test_by_default_every_step_runs_the_modules_and_their_hooks_fire(monkeypatch):
    fast_steps, calls = [], []
    step = FastDecoder.__call__
    monkeypatch.setattr(FastDecoder, "__call__",
                        lambda self, token, cache: fast_steps.append(1) or step(self, token, cache))
    for cfg in (GPT, LLAMA):
        model = model_of(cfg)
        assert fast_decoder(model) is not None, "an unhooked model could run fast: the default must not"
        calls.clear()
        handles = [block.attn.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
                   for block in model.blocks]
        generate(model, torch.zeros(2, 3, dtype=torch.long), 6)
        for handle in handles:
            handle.remove()
        expected = [(2, 3, 32)] * 2 + [(2, 1, 32)] * 2 * 5  # the prompt, then five one-token steps, 2 layers
        assert calls == expected, f"{cfg.norm}: the hooks on MultiHeadAttention must fire at every step, got {calls}"
    assert fast_steps == [], f"by default no step may go through FastDecoder; {len(fast_steps)} did"


def test_fast_true_refuses_a_hooked_model_and_says_where():
    model = model_of(GPT)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    handle = model.blocks[1].ffn.register_forward_hook(lambda module, args, out: None)
    assert fast_decoder(model) is None, "a forward hook on one FFN must keep the module path"
    with pytest.raises(ValueError, match=r"fast=True.*blocks\.1\.ffn has a forward hook"):
        generate(model, prompt, 6, fast=True)
    handle.remove()
    assert fast_decoder(model) is not None, "without the hook the fast path is back"
    pre = model.embed.register_forward_pre_hook(lambda module, args: None)
    assert "embed has a forward hook or pre-hook" in why_not_fast(model), "a pre-hook must keep the module path"
    pre.remove()
    assert why_not_fast(model) is None


def test_fast_true_is_checked_at_the_boundary():
    model = model_of(GPT)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="needs use_cache=True"):
        generate(model, prompt, 4, fast=True, use_cache=False)
    with pytest.raises(ValueError, match="fast must be True or False"):
        generate(model, prompt, 4, fast=1)
    model.train()  # generate runs in eval mode, so training mode is no reason to refuse
    fast = generate(model, prompt, 4, fast=True)
    assert model.training, "generate must restore training mode"
    assert torch.equal(fast, generate(model, prompt, 4)), "fast=True and the modules chose different tokens"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Module.compile imports torch's compiler
def test_global_hooks_parametrizations_and_foreign_parts_get_no_fast_decoder(monkeypatch):
    model = model_of(GPT)
    for register in (nn.modules.module.register_module_forward_hook,
                     nn.modules.module.register_module_forward_pre_hook):
        handle = register(lambda module, *args: None)
        try:
            assert fast_decoder(model) is None, register.__name__
        finally:
            handle.remove()
    assert fast_decoder(model) is not None, "without global hooks the fast path is back"

    for place, part in (("final_norm", nn.Linear(32, 32)), ("blocks.0.ffn", nn.Identity()),
                        ("blocks.1.attn_sublayer.norm", nn.Linear(32, 32)), ("embed.positions", nn.Identity())):
        ablated = model_of(GPT)
        parent, _, name = place.rpartition(".")
        setattr(ablated.get_submodule(parent) if parent else ablated, name, part)
        assert fast_decoder(ablated.eval()) is None, place
        assert why_not_fast(ablated).startswith(place), f"{place}: {why_not_fast(ablated)}"
        prompt = torch.zeros(1, 3, dtype=torch.long)
        with pytest.raises(ValueError, match=f"fast=True.*{re.escape(place)}"):
            generate(ablated, prompt, 4, fast=True)
        if place != "embed.positions":  # (an Identity cannot be called with positions: the modules fail too)
            generate(ablated, prompt, 4)  # runs through the modules

    dropout_on = model_of(GPT)
    dropout_on.blocks[0].ffn.dropout.train()  # e.g. Monte Carlo dropout
    assert fast_decoder(dropout_on) is None, "a dropout in training mode must keep the module path"

    compiled = model_of(GPT)
    compiled.blocks[0].compile()  # in place: the module path would run the compiled forward
    assert fast_decoder(compiled) is None, "a block compiled in place must keep the module path"

    with monkeypatch.context() as patch:
        patch.setattr(nn.LayerNorm, "forward", lambda self, x: x)  # a forward patched on the class
        assert fast_decoder(model) is None, "a forward patched on the class must keep the module path"
    assert fast_decoder(model) is not None, "with the class's own forward back, the fast path is back"

    class LearnersAttention(MultiHeadAttention):  # a subclass may compute something else
        pass

    swapped = model_of(GPT)
    old = swapped.blocks[0].attn
    swapped.blocks[0].attn = LearnersAttention(old.d_model, old.n_heads)
    assert fast_decoder(swapped) is None, "a subclass of MultiHeadAttention may compute something else"

    patched = model_of(GPT)
    patched.final_norm.forward = lambda x: x  # a replaced forward on one instance
    assert fast_decoder(patched) is None, "a forward replaced on one instance must keep the module path"

    parametrized = model_of(GPT)
    nn.utils.parametrizations.weight_norm(parametrized.blocks[0].attn.out)
    assert fast_decoder(parametrized) is None, "a parametrized weight must keep the module path"

    class Subclass(DecoderOnlyLM):
        pass

    assert fast_decoder(Subclass(GPT).eval()) is None, "a subclass of DecoderOnlyLM may compute something else"
    assert fast_decoder(model_of(GPT).train()) is None, "training mode: dropout is the modules' business"


def test_return_logits_and_sampling_are_unchanged_by_the_fast_path():
    model = model_of(GPT)
    prompt = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(5))
    assert_same(*both_paths(model, prompt, 15, Sampler(temperature=0.8, top_p=0.9), seed=6), "top-p sampling")


@pytest.mark.parametrize("name", ["gpt", "llama (GQA, RoPE, RMSNorm, SwiGLU)", "mixture of experts, one dense layer"])
def test_under_bf16_autocast_the_fast_steps_match_the_modules(name):
    model = model_of(CONFIGS[name])
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, slow = both_paths(model, prompt, 12)
    assert fast[1].dtype == torch.bfloat16, "autocast must reach the fast path's matrix products"
    assert_same(fast, slow, f"{name} under bf16 autocast")


def test_a_post_ln_feed_forward_in_a_pre_ln_block_is_followed():
    model = model_of(LLAMA)
    model.blocks[1].ffn_sublayer.order = "post"  # each sublayer's order is its own
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(8))
    assert_same(*both_paths(model, prompt, 8), "a post-LN FFN in a pre-LN block")


def test_fast_true_takes_every_one_token_step_through_the_fast_decoder(monkeypatch):
    calls = []
    step = FastDecoder.__call__
    monkeypatch.setattr(FastDecoder, "__call__", lambda self, token, cache: calls.append(1) or step(self, token, cache))
    model = model_of(LLAMA)
    generate(model, torch.zeros(2, 3, dtype=torch.long), 9)
    assert calls == [], "by default every step goes through the modules"
    generate(model, torch.zeros(2, 3, dtype=torch.long), 9, fast=True)
    assert len(calls) == 8, "the prompt goes through the modules, each later step through FastDecoder"
    calls.clear()
    generate(model, torch.zeros(1, 35, dtype=torch.long), 9, fast=True)  # max_len 40
    # the tokens at positions 35-39 go through FastDecoder; from then on the window is full and
    # every step refills the cache from the last 40 tokens through the modules
    assert len(calls) == 5, f"positions 35-39 through FastDecoder, the refills through the modules; got {len(calls)}"


@pytest.mark.parametrize("scale", [1e-20, 1e-3, 1.0, 1e3])
def test_rms_norm_steps_give_the_bits_of_torchs_rms_norm(scale):
    # FastDecoder's RMSNorm: equal bit for bit, or its logits would differ from the modules'.
    # A torch whose rms_norm computes differently (a fused CPU kernel) fails here first.
    weight = torch.randn(96) * 2
    x = torch.randn(500, 3, 96) * scale
    width, eps = torch.tensor(96.0), torch.tensor(1e-6)
    assert torch.equal(rms_norm_steps(x, weight, width, eps), torch.nn.functional.rms_norm(x, (96,), weight, 1e-6))
