"""The decoder-only model: parity with Hugging Face GPT-2 and LLaMA (copied weights), causality,
and cached generation equal to uncached generation."""

import dataclasses

import pytest
import torch

from tutorial_lib.config import GPT_TINY, LLAMA_TINY, ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.sampling import GREEDY, Sampler, generate

ATOL = 1e-5
FLAVOURS = {
    "gpt": dataclasses.replace(GPT_TINY, vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=24),
    "llama": dataclasses.replace(LLAMA_TINY, vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                 d_ff=64, max_len=24),
    "llama-mha": dataclasses.replace(LLAMA_TINY, vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                                     d_ff=64, max_len=24),
    "alibi": ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=24, positions="alibi"),
}


def build(name):
    torch.manual_seed(0)
    return DecoderOnlyLM(FLAVOURS[name]).eval()


@pytest.mark.parametrize("name", FLAVOURS)
def test_outputs_at_t_do_not_depend_on_tokens_after_t(name):
    model = build(name)
    ids = torch.randint(0, 50, (2, 12))
    before = model(ids).logits
    for t in (0, 5, 10):
        changed = ids.clone()
        changed[:, t + 1 :] = torch.randint(0, 50, (2, 11 - t))
        after = model(changed).logits
        torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], atol=ATOL, rtol=0)


def test_gpt_flavour_equals_hf_gpt2_with_copied_weights():
    transformers = pytest.importorskip("transformers")
    from tutorial_lib.convert import gpt2_from_hf

    hf_cfg = transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=48, n_layer=3, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = gpt2_from_hf(hf)
    assert ours.cfg.ffn == "gelu_tanh" and ours.cfg.tie_embeddings
    ids = torch.randint(0, 61, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
        hf_loss = torch.nn.functional.cross_entropy(hf(ids).logits.flatten(0, 1), ids.flatten())
        assert abs(ours(ids, ids).loss - hf_loss) < 1e-5


@pytest.mark.parametrize("kv_heads,tie", [(2, False), (1, False), (4, True)])
def test_llama_flavour_equals_hf_llama_with_grouped_query_attention(kv_heads, tie):
    transformers = pytest.importorskip("transformers")
    from tutorial_lib.convert import llama_from_hf

    hf_cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads,
                                      max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tie)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    ours = llama_from_hf(hf)
    assert ours.cfg.kv_heads == kv_heads and ours.cfg.positions == "rope" and ours.cfg.norm == "rmsnorm"
    ids = torch.randint(0, 61, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["gpt", "llama", "llama-mha", "alibi"])
def test_cached_and_uncached_generation_give_identical_tokens_and_logits(name):
    model = build(name)
    prompt = torch.randint(0, 50, (3, 5))
    sampler = Sampler(temperature=0.9, top_k=20)
    a, la = generate(model, prompt, 30, sampler=sampler, use_cache=True,
                     generator=torch.Generator().manual_seed(1), return_logits=True)
    b, lb = generate(model, prompt, 30, sampler=sampler, use_cache=False,
                     generator=torch.Generator().manual_seed(1), return_logits=True)
    # 5 + 30 > max_len = 24: both crop the window past the context length
    assert torch.equal(a, b)
    torch.testing.assert_close(la, lb, atol=ATOL, rtol=0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_reads_the_ids_on_the_host_once_not_at_every_step(monkeypatch, use_cache):
    # the value check of the ids is a device sync; generate checks the prompt and the model
    # skips the check at every step, whose new token is an id by construction
    import tutorial_lib.gpt
    import tutorial_lib.sampling

    checked = []

    def counting(module):
        original = module.check_id_values

        def check(*ranges):
            checked.extend(tuple(r.values.shape) for r in ranges)
            return original(*ranges)

        monkeypatch.setattr(module, "check_id_values", check)

    counting(tutorial_lib.gpt)
    counting(tutorial_lib.sampling)
    model = build("gpt")
    out = generate(model, torch.randint(0, 50, (2, 5)), 12, use_cache=use_cache)
    assert out.shape == (2, 17), f"expected 12 new tokens, got shape {tuple(out.shape)}"
    assert checked == [(2, 5)], f"expected one check of the (2, 5) prompt, got checks of {checked}"
    with pytest.raises(ValueError, match=r"ids must hold ids in \[0, 49\]"):
        generate(model, torch.full((1, 3), 50), 2, use_cache=use_cache)


def test_cache_positions_come_from_the_cache_length():
    model = build("llama")
    ids = torch.randint(0, 50, (1, 8))
    full = model(ids).logits
    cache = model.new_cache()
    model(ids[:, :5], cache=cache)
    assert len(cache) == 5
    step = model(ids[:, 5:6], cache=cache).logits
    torch.testing.assert_close(step[:, 0], full[:, 5], atol=ATOL, rtol=0)


def test_attention_weights_are_the_same_with_and_without_the_cache():
    model = build("gpt")
    ids = torch.randint(0, 50, (1, 6))
    full = model(ids, need_weights=True).attn  # (L, B, h, T, T)
    cache = model.new_cache()
    model(ids[:, :5], cache=cache)
    last = model(ids[:, 5:], cache=cache, need_weights=True).attn  # (L, B, h, 1, 6)
    torch.testing.assert_close(last[..., 0, :], full[..., 5, :], atol=ATOL, rtol=0)


def test_model_refuses_contexts_longer_than_max_len_and_bad_ids():
    model = build("gpt")
    with pytest.raises(ValueError, match=r"ids has 25 positions, but the model's context is max_len=24"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="ids must hold integer token ids, got dtype torch.float32"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match=r"ids must hold ids in \[0, 49\] \(size 50\); it holds \[50\], "
                                         r"first at ids\[0, 0\]"):
        model(torch.full((1, 5), 50))
    with pytest.raises(ValueError, match=r"it holds \[-1\], first at ids\[0, 1\]"):
        model(torch.tensor([[3, -1, 7]]))
    with pytest.raises(ValueError, match="family='decoder'"):
        DecoderOnlyLM(ModelConfig(family="encoder"))


def counting_value_checks(monkeypatch, *modules) -> list[list[str]]:
    """Record the names checked by each call of check_id_values in these modules."""
    calls = []
    for module in modules:
        original = module.check_id_values

        def check(*ranges, original=original):
            calls.append([r.name for r in ranges])
            return original(*ranges)

        monkeypatch.setattr(module, "check_id_values", check)
    return calls


def test_forward_reads_ids_and_targets_on_the_host_once(monkeypatch):
    import tutorial_lib.gpt
    import tutorial_lib.layers

    calls = counting_value_checks(monkeypatch, tutorial_lib.gpt, tutorial_lib.layers)
    model = build("gpt")
    ids = torch.randint(0, 50, (2, 5))
    model(ids, ids)
    assert calls == [["ids", "targets"]], f"expected one check of ids and targets together, got {calls}"


def test_check_ids_false_skips_the_checks_of_the_ids_only():
    model = build("gpt")
    ids = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(model(ids, check_ids=False).logits, model(ids).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"targets must hold class ids in \[0, 49\]"):
        model(ids, torch.full((2, 5), 50), check_ids=False)
    with pytest.raises(ValueError, match="3-D mask"):
        model(ids, mask=torch.ones(2, 5, 5, dtype=torch.bool), check_ids=False)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_generated_ids_and_a_model_run_under_inference_mode_can_still_be_trained(name):
    """generate() runs under torch.inference_mode; what it returns and what the model keeps
    (RoPE's cos/sin table) must still work in a later backward pass."""
    model = build(name)
    with torch.inference_mode():
        model(torch.randint(0, 50, (1, 20)))  # the first call builds the rotary table
    out, logits = generate(model, torch.randint(0, 50, (2, 4)), 8, return_logits=True)
    assert not out.is_inference() and not logits.is_inference(), "generate must return ordinary tensors"
    model.train()
    model(out[:, :-1], out[:, 1:]).loss.backward()  # raises if an inference tensor is saved for backward
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"no gradient reached {missing}"


def test_tied_gpt_and_untied_llama_heads():
    gpt = build("gpt")
    assert gpt.head.weight is gpt.embed.tokens.weight
    llama = build("llama")
    assert llama.head.weight is not llama.embed.tokens.weight
    assert all(".bias" not in n for n, _ in llama.named_parameters()), "the LLaMA flavour has no biases"


def test_greedy_generation_is_deterministic_and_extends_the_prompt():
    model = build("gpt")
    prompt = torch.randint(0, 50, (2, 4))
    out = generate(model, prompt, 6, sampler=GREEDY)
    assert out.shape == (2, 10) and torch.equal(out[:, :4], prompt)
    assert torch.equal(out, generate(model, prompt, 6, sampler=GREEDY))
    # the greedy token is the arg-max of the model's own logits
    assert torch.equal(out[:, 4], model(prompt).logits[:, -1].argmax(-1))
