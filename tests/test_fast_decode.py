"""FastDecoder: the cached decoding step without module calls gives the logits of the modules,
bit for bit, for every kind of decoder-only block this package builds; a model with hooks or
parts it does not know gets no fast decoder, and generate then runs the modules."""

import dataclasses

import pytest
import torch
from torch import nn

from tutorial_lib.attention import LayerKVCache, MultiHeadAttention
from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.fast_decode import FastDecoder, fast_decoder
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
    """generate's (ids, logits) through FastDecoder, then through the modules (a hook that does
    nothing forces them); a sampling generator is made afresh from ``seed`` for each."""
    def run():
        extra = {} if sampler is None else {"sampler": sampler, "generator": torch.Generator().manual_seed(seed)}
        return generate(model, prompt, n, return_logits=True, **extra)

    assert fast_decoder(model) is not None, "this model should get a fast decoder"
    fast = run()
    handle = model.register_forward_hook(lambda *args: None)
    try:
        assert fast_decoder(model) is None, "a hooked model must keep the module path"
        slow = run()
    finally:
        handle.remove()
    return fast, slow


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
    cached = generate(model, prompt, 25, sampler=sampler, generator=torch.Generator().manual_seed(4),
                      return_logits=True)  # 55 positions > max_len 40: the cache is refilled
    recomputed = generate(model, prompt, 25, sampler=sampler, generator=torch.Generator().manual_seed(4),
                          use_cache=False, return_logits=True)
    assert torch.equal(cached[0], recomputed[0]), "cached and recomputed generation chose different tokens"
    torch.testing.assert_close(cached[1], recomputed[1], atol=1e-5, rtol=1e-5)


def test_a_hook_anywhere_sends_generate_through_the_modules():
    model = model_of(GPT)
    calls = []
    handle = model.blocks[1].ffn.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    assert fast_decoder(model) is None, "a forward hook on one FFN must keep the module path"
    generate(model, torch.zeros(1, 3, dtype=torch.long), 6)
    assert calls == [(1, 3, 32)] + [(1, 1, 32)] * 5, "the hook must see the prompt and every one-token step"
    handle.remove()
    assert fast_decoder(model) is not None, "without the hook the fast path is back"
    pre = model.embed.register_forward_pre_hook(lambda module, args: None)
    assert fast_decoder(model) is None, "a pre-hook must keep the module path"
    pre.remove()


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
        prompt = torch.zeros(1, 3, dtype=torch.long)
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


def test_generate_takes_every_one_token_step_through_the_fast_decoder(monkeypatch):
    calls = []
    step = FastDecoder.__call__
    monkeypatch.setattr(FastDecoder, "__call__", lambda self, token, cache: calls.append(1) or step(self, token, cache))
    model = model_of(LLAMA)
    generate(model, torch.zeros(2, 3, dtype=torch.long), 9)
    assert len(calls) == 8, "the prompt goes through the modules, each later step through FastDecoder"
    calls.clear()
    generate(model, torch.zeros(1, 35, dtype=torch.long), 9)  # max_len 40
    # the tokens at positions 35-39 go through FastDecoder; from then on the window is full and
    # every step refills the cache from the last 40 tokens through the modules
    assert len(calls) == 5, f"positions 35-39 through FastDecoder, the refills through the modules; got {len(calls)}"


@pytest.mark.parametrize("capacity", [None, 3, 64])
def test_append_one_makes_the_cache_that_append_makes(capacity):
    # empty (first buffers), full (room doubles) and roomy caches
    plain, fast = LayerKVCache(capacity), LayerKVCache(capacity)
    for step in range(7):
        k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        keys, values = plain.append(k, v)
        fast_keys, fast_values = fast.append_one(k, v)
        assert torch.equal(fast_keys, keys) and torch.equal(fast_values, values), f"step {step}: another cache"
        assert len(fast) == len(plain) == step + 1, f"step {step}: lengths {len(fast)} and {len(plain)}"
