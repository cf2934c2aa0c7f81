"""The mixture-of-experts FFN (tutorial_lib.moe) and the models built with it: against
transformers' Mixtral, Qwen2-MoE and DeepSeek-V2 blocks with copied weights, against a
token-by-token loop, against transformers' load-balancing loss, and inside DecoderOnlyLM."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tutorial_lib.config import LLAMA_TINY, ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.layers import FeedForward
from tutorial_lib.moe import (
    MoEFeedForward,
    capacity_mask,
    capture_routing,
    expert_capacity,
    expert_counts,
    load_balancing_loss,
    route,
)
from tutorial_lib.params import count_parameters, counted, expected_parameters, unique_parameter_count
from tutorial_lib.train import loss_with_aux, make_optimizer, train

MOE = dataclasses.replace(LLAMA_TINY, vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24,
                          max_len=32, n_experts=4, experts_per_token=2)


def moe_block(**changes) -> MoEFeedForward:
    torch.manual_seed(0)
    block = MoEFeedForward(dataclasses.replace(MOE, **changes))
    for p in block.parameters():  # larger than init_weights' 0.02, so that routing and outputs differ visibly
        torch.nn.init.normal_(p, std=0.3)
    return block


def copy_experts(ours: MoEFeedForward, theirs) -> None:
    """transformers keeps each expert's gate and up rows in one (E, 2f, d) tensor, gate first."""
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        for e, expert in enumerate(ours.experts):
            theirs.experts.gate_up_proj[e].copy_(torch.cat([expert.gate.weight, expert.up.weight]))
            theirs.experts.down_proj[e].copy_(expert.down.weight)


def copy_ffn(ours: FeedForward, theirs) -> None:
    with torch.no_grad():
        theirs.gate_proj.weight.copy_(ours.gate.weight)
        theirs.up_proj.weight.copy_(ours.up.weight)
        theirs.down_proj.weight.copy_(ours.down.weight)


# ---- routing ------------------------------------------------------------------------------------

def test_route_by_hand():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    probs = logits.softmax(-1)
    weights, experts = route(logits, 2, renormalise=False)
    assert experts.tolist() == [[0, 2], [2, 3]], "the two most probable experts, best first"
    torch.testing.assert_close(weights, torch.stack([probs[0, [0, 2]], probs[1, [2, 3]]]))
    renormalised, same = route(logits, 2)
    assert torch.equal(same, experts)
    e = math.e
    torch.testing.assert_close(renormalised[0], torch.tensor([e**2, e]) / (e**2 + e))  # softmax over the two
    torch.testing.assert_close(renormalised.sum(-1), torch.ones(2))
    assert route(logits.half(), 1)[0].dtype == torch.float16, "weights come back in the logits' dtype"


@pytest.mark.parametrize("logits,k,match", [
    (torch.zeros(3, 4), 5, r"k must be an int in \[1, 4\]"),
    (torch.zeros(3, 4), 0, r"k must be an int in \[1, 4\]"),
    (torch.zeros(2, 3, 4), 2, r"shape \(tokens, experts\), got torch.float32 tensor of shape \(2, 3, 4\)"),
    (torch.zeros(3, 4, dtype=torch.long), 2, "must be a float tensor"),
])
def test_route_and_the_loss_refuse_bad_input(logits, k, match):
    for fn in (route, load_balancing_loss):
        with pytest.raises(ValueError, match=match):
            fn(logits, k)


# ---- the block against transformers ------------------------------------------------------------

def test_block_equals_transformers_mixtral_block_outputs_router_logits_and_gradients():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    ours = moe_block()
    hf_cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, experts_implementation="eager")
    theirs = MixtralSparseMoeBlock(hf_cfg)
    copy_experts(ours, theirs)
    x = torch.randn(3, 7, 16)
    out = ours(x)
    expected = theirs(x)
    torch.testing.assert_close(out.x, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.routing.logits, theirs.gate(x)[0], atol=1e-6, rtol=0)
    assert len(set(out.routing.experts.flatten().tolist())) == 4, "every expert got tokens: a real test of the loop"
    out.x.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(ours.router.weight.grad, theirs.gate.weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.experts[3].down.weight.grad, theirs.experts.down_proj.grad[3], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("renormalise", [False, True])
def test_block_equals_transformers_qwen2_moe_block_with_its_gated_shared_expert(renormalise):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    ours = moe_block(expert_d_ff=12, n_shared_experts=1, shared_d_ff=20, shared_expert_gate=True,
                     renormalise_topk=renormalise)
    hf_cfg = transformers.Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=renormalise,
                                         experts_implementation="eager")
    theirs = Qwen2MoeSparseMoeBlock(hf_cfg)
    copy_experts(ours, theirs)
    copy_ffn(ours.shared, theirs.shared_expert)
    with torch.no_grad():
        theirs.shared_expert_gate.weight.copy_(ours.shared_gate.weight)
    x = torch.randn(2, 9, 16)
    out = ours(x)
    torch.testing.assert_close(out.x, theirs(x), atol=1e-6, rtol=1e-5)
    flat = x.view(-1, 16)
    _, weights, experts = theirs.gate(flat)
    routed = out.x.view(-1, 16) - torch.sigmoid(ours.shared_gate(flat)) * ours.shared(flat)
    torch.testing.assert_close(routed, theirs.experts(flat, experts, weights), atol=1e-6, rtol=1e-5)
    weight_sums = out.routing.weights.sum(-1)
    assert torch.allclose(weight_sums, torch.ones(18)) == renormalise, "renormalised weights sum to 1, others not"


def test_block_equals_transformers_deepseek_v2_block_with_two_ungated_shared_experts():
    """DeepSeek's shared experts: n_shared_experts of width moe_intermediate_size, no gate,
    built as one FFN of width n_shared * f on both sides; greedy top-k of the softmax, not
    renormalised (routed_scaling_factor 1)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    ours = moe_block(expert_d_ff=12, n_shared_experts=2, renormalise_topk=False)
    assert ours.shared.up.out_features == 24 and ours.shared_gate is None
    hf_cfg = transformers.DeepseekV2Config(hidden_size=16, moe_intermediate_size=12, n_routed_experts=4,
                                           n_shared_experts=2, num_experts_per_tok=2, topk_method="greedy",
                                           num_attention_heads=2, num_key_value_heads=2,
                                           routed_scaling_factor=1.0, experts_implementation="eager")
    theirs = DeepseekV2Moe(hf_cfg)
    copy_experts(ours, theirs)
    copy_ffn(ours.shared, theirs.shared_experts)
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(ours(x).x, theirs(x), atol=1e-6, rtol=1e-5)


# ---- the loop is dropless: the same as one token at a time --------------------------------------

def test_every_token_reaches_its_k_experts_even_when_all_pick_the_same_ones():
    block = moe_block(experts_per_token=2)
    with torch.no_grad():  # every token prefers experts 1 and 3 by far: no capacity limit may drop any
        block.router.weight[1] += 5.0
        block.router.weight[3] += 4.0
    x = torch.randn(4, 5, 16).abs()  # positive inputs, so that the bias above wins for every token
    out = block(x)
    assert (out.routing.experts == torch.tensor([1, 3])).all(), "the test needs every token on experts 1 and 3"
    flat = x.reshape(-1, 16)
    for n in range(flat.size(0)):  # one token at a time, written out
        probs = block.router(flat[n]).softmax(-1)
        top = probs.topk(2)
        expected = sum(w / top.values.sum() * block.experts[e](flat[n]) for w, e in zip(top.values, top.indices))
        torch.testing.assert_close(out.x.reshape(-1, 16)[n], expected, atol=1e-6, rtol=1e-5)
    assert expert_counts(out.routing.experts, 4).tolist() == [0, 20, 0, 20]


def test_a_moe_model_trains_under_bf16_autocast():
    """Under autocast the experts' outputs are bfloat16 while the output buffer is float32:
    the scatter must convert (a GPU with bf16 trains the notebooks' models this way)."""
    torch.manual_seed(0)
    model = DecoderOnlyLM(dataclasses.replace(MOE, n_shared_experts=1, shared_expert_gate=True))
    ids = torch.randint(0, 40, (2, 12))
    reference = model(ids, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, ids)
    (out.loss + 0.01 * out.aux_loss).backward()
    assert abs(out.loss.item() - reference.loss.item()) < 0.05, "bf16 is close to float32"
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_block_checks_its_input_before_routing_it():
    with pytest.raises(ValueError, match=r"x must be float vectors of shape \(B, T, d_model=16\), got torch.float32 "
                                         r"\(2, 3, 8\)"):
        moe_block()(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"x must be float vectors .* got torch.int64 \(2, 3, 16\)"):
        moe_block()(torch.zeros(2, 3, 16, dtype=torch.long))


def test_expert_counts_refuses_indices_outside_the_experts():
    assert expert_counts(torch.tensor([[0, 2], [2, 1]]), 4).tolist() == [1, 1, 2, 0]
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\], got values from 0 to 4"):
        expert_counts(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="integer tensor"):
        expert_counts(torch.tensor([[0.0, 1.0]]), 4)


def test_one_expert_chosen_with_weight_one_is_the_dense_ffn():
    cfg = dataclasses.replace(MOE, n_experts=1, experts_per_token=1)
    torch.manual_seed(0)
    moe = DecoderOnlyLM(cfg)
    dense = DecoderOnlyLM(dataclasses.replace(cfg, n_experts=0, experts_per_token=2))
    state = {k.replace("ffn.experts.0.", "ffn."): v for k, v in moe.state_dict().items() if "router" not in k}
    dense.load_state_dict(state)
    ids = torch.randint(0, 40, (2, 11))
    torch.testing.assert_close(moe(ids).logits, dense(ids).logits, atol=1e-6, rtol=0)


# ---- the load-balancing loss ------------------------------------------------------------------------

def test_load_balancing_loss_equals_transformers_for_one_layer_and_pooled_layers():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = [torch.randn(30, 6) * 2 for _ in range(3)]
    for k in (1, 2, 4):
        torch.testing.assert_close(load_balancing_loss(layers[0], k), load_balancing_loss_func((layers[0],), 6, k))
        # transformers pools all layers' counts and probabilities: ours on the concatenated logits
        pooled = load_balancing_loss_func(tuple(layers), 6, k)
        torch.testing.assert_close(load_balancing_loss(torch.cat(layers), k), pooled)
    per_layer = torch.stack([load_balancing_loss(x, 2) for x in layers]).mean()
    assert abs(per_layer - load_balancing_loss_func(tuple(layers), 6, 2)) > 1e-4, \
        "the mean of per-layer losses is not the pooled value: the model's choice is a real one"


def test_load_balancing_loss_is_k_when_balanced_and_e_when_collapsed():
    E = 8
    balanced = torch.eye(E) * 50  # token i sends everything to expert i: f_i = P_i = 1/E
    assert load_balancing_loss(balanced, 1).item() == pytest.approx(1.0, abs=1e-6)
    collapsed = torch.zeros(20, E)
    collapsed[:, :2] = 50  # every token sends everything to experts 0 and 1
    assert load_balancing_loss(collapsed, 2).item() == pytest.approx(E, abs=1e-6)
    uniform = torch.zeros(20, E)  # P_i = 1/E: the loss is sum_i f_i = k, whatever top-k picks among ties
    assert load_balancing_loss(uniform, 3).item() == pytest.approx(3.0, abs=1e-6)


# ---- inside the language model --------------------------------------------------------------------

def test_model_builds_moe_layers_where_the_config_says_and_returns_the_mean_aux_loss():
    cfg = dataclasses.replace(MOE, n_layers=3, dense_layers=(1,))
    torch.manual_seed(0)
    model = DecoderOnlyLM(cfg)
    kinds = [type(block.ffn) for block in model.blocks]
    assert kinds == [MoEFeedForward, FeedForward, MoEFeedForward]
    ids = torch.randint(0, 40, (2, 12))
    with capture_routing(model) as routed:
        out = model(ids)
    assert sorted(routed) == ["blocks.0.ffn", "blocks.2.ffn"]
    expected = (load_balancing_loss(routed["blocks.0.ffn"].logits, 2)
                + load_balancing_loss(routed["blocks.2.ffn"].logits, 2)) / 2
    torch.testing.assert_close(out.aux_loss, expected)
    assert out.loss is None and routed["blocks.0.ffn"].experts.shape == (24, 2)
    assert not model.blocks[0].ffn._forward_hooks, "capture_routing removed its hooks"
    assert DecoderOnlyLM(dataclasses.replace(MOE, n_experts=0)).forward(ids).aux_loss is None, "dense: no aux loss"
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        with capture_routing(DecoderOnlyLM(dataclasses.replace(MOE, n_experts=0))):
            pass


def test_cached_decoding_of_a_moe_model_equals_the_full_pass():
    torch.manual_seed(0)
    model = DecoderOnlyLM(dataclasses.replace(MOE, n_shared_experts=1, shared_expert_gate=True)).eval()
    ids = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        model(ids[:, :6], cache=cache)
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(6, 10)], dim=1)
    torch.testing.assert_close(steps, full[:, 6:], atol=1e-5, rtol=0)


def test_training_with_the_aux_loss_moves_the_router_and_the_coefficient_counts():
    cfg = dataclasses.replace(MOE, n_layers=1)
    ids = torch.randint(0, 40, (4, 16))
    torch.manual_seed(0)
    model = DecoderOnlyLM(cfg)
    model(ids, ids).aux_loss.backward()  # the aux loss alone reaches the router (through P, not the counts)
    assert model.blocks[0].ffn.router.weight.grad.abs().sum() > 0
    grads = {}
    for coefficient in (0.0, 1.0):
        torch.manual_seed(0)
        model = DecoderOnlyLM(cfg)
        loss = loss_with_aux(coefficient)(model, (ids, ids))
        out = model(ids, ids)
        torch.testing.assert_close(loss, out.loss + coefficient * out.aux_loss)
        loss.backward()
        grads[coefficient] = model.blocks[0].ffn.router.weight.grad.clone()
    assert not torch.allclose(grads[0.0], grads[1.0]), "the coefficient changes the router's gradient"
    history = train(model, lambda step: (ids, ids), 3, optimizer=make_optimizer(model, 1e-2),
                    compute_loss=loss_with_aux(0.01), progress=False)
    assert len(history.loss) == 3 and all(math.isfinite(x) for x in history.loss)
    with pytest.raises(ValueError, match="coefficient must be a number >= 0"):
        loss_with_aux(-1.0)


# ---- counting a built MoE model ---------------------------------------------------------------------

@st.composite
def moe_configs(draw):
    n_layers = draw(st.integers(1, 3))
    n_experts = draw(st.integers(1, 5))
    n_shared = draw(st.integers(0, 2))
    return ModelConfig(
        vocab_size=draw(st.integers(3, 30)), d_model=8, n_layers=n_layers, n_heads=2, max_len=8,
        d_ff=draw(st.sampled_from([None, 6])), ffn=draw(st.sampled_from(["gelu", "swiglu"])),
        bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        n_experts=n_experts, experts_per_token=draw(st.integers(1, n_experts)),
        expert_d_ff=draw(st.sampled_from([None, 4])), n_shared_experts=n_shared,
        shared_d_ff=draw(st.sampled_from([None, 3])) if n_shared else None,
        shared_expert_gate=draw(st.booleans()) if n_shared else False,
        dense_layers=tuple(i for i in range(n_layers - 1) if draw(st.booleans())),  # the last one has experts
    )


@settings(max_examples=40, deadline=None)
@given(moe_configs())
def test_expected_equals_measured_for_moe_models_with_active(cfg):
    with torch.device("meta"):
        model = DecoderOnlyLM(cfg)
    measured = count_parameters(model)
    assert measured == expected_parameters(cfg)
    assert measured["total"] == unique_parameter_count(model)
    assert measured["active"] <= measured["total"]


@pytest.mark.parametrize("changes,match", [
    (dict(n_experts=-1), r"n_experts must be a non-negative int \(an int >= 0\), got -1"),
    (dict(n_experts=4, experts_per_token=5), r"experts_per_token must be an int in \[1, n_experts=4\], got 5"),
    (dict(n_experts=0, n_shared_experts=1), "n_shared_experts describe a mixture of experts, but n_experts=0"),
    (dict(n_experts=0, dense_layers=(0,)), "dense_layers describe a mixture of experts"),
    (dict(n_experts=4, dense_layers=(0, 2)), r"dense_layers must hold distinct layer indices in \[0, 1\]"),
    (dict(n_experts=4, dense_layers=(0, 0)), "distinct layer indices"),
    (dict(n_experts=4, dense_layers=(0, 1)), "leaves no mixture of experts"),
    (dict(n_experts=4, dense_layers="0"), "dense_layers must be a tuple of layer indices"),
    (dict(n_experts=4, shared_expert_gate=True), "shared_expert_gate scales the shared experts"),
    (dict(n_experts=4, expert_d_ff=0), r"expert_d_ff must be a positive int \(an int >= 1\) or None, got 0"),
    (dict(n_experts=4, family="encoder"), "mixtures of experts are built for decoder-only models"),
    (dict(q_lora_rank=8), "give kv_lora_rank as well"),
    (dict(kv_lora_rank=8, rope_head_dim=3), r"rope_head_dim must be even \(RoPE rotates pairs of dimensions\), got 3"),
    (dict(kv_lora_rank=8, n_kv_heads=1), "leave n_kv_heads unset"),
    (dict(kv_lora_rank=8, positions="learned"), "positions='rope'"),
])
def test_config_refuses_inconsistent_expert_and_latent_attention_fields(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(counted(MOE), **changes)  # latent attention: fields of the counting config


def test_dense_layers_read_from_json_become_a_tuple_and_unbuilt_attention_is_refused():
    cfg = ModelConfig.from_dict(MOE.to_dict() | {"dense_layers": [1]})
    assert cfg.dense_layers == (1,) and cfg.moe_layers == (0,) and hash(cfg)
    for changes, match in ((dict(qk_norm=True), "qk_norm=True"), (dict(kv_lora_rank=8, n_kv_heads=None), "latent")):
        with pytest.raises(ValueError, match=match):
            DecoderOnlyLM(dataclasses.replace(counted(MOE), **changes))


# ---- a capacity factor: assignments past an expert's slots are dropped -----------------------------

def kept_by_a_loop(experts: list[list[int]], n_experts: int, capacity: int) -> list[list[bool]]:
    """The rule written out: first choices of all tokens in order, then second choices, ...;
    an expert accepts an assignment while it has fewer than `capacity`."""
    taken = [0] * n_experts
    kept = [[False] * len(row) for row in experts]
    for choice in range(len(experts[0])):
        for token, row in enumerate(experts):
            if taken[row[choice]] < capacity:
                taken[row[choice]] += 1
                kept[token][choice] = True
    return kept


def test_expert_capacity_by_hand():
    assert expert_capacity(10, 2, 4, 1.0) == 5  # 20 assignments over 4 experts
    assert expert_capacity(10, 2, 4, 1.25) == 7  # ceil(6.25)
    assert expert_capacity(10, 2, 4, 2.0) == 10  # E / k: every token, nothing can be dropped
    assert expert_capacity(3, 1, 8, 0.1) == 1  # ceil of 0.0375


def test_capacity_mask_by_hand():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])  # capacity ceil(1.0 * 4 * 2 / 4) = 2
    assert capacity_mask(experts, 4, 1.0).tolist() == [[True, True], [True, True], [False, False], [True, False]]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 4), st.integers(0, 3), st.sampled_from([0.3, 0.5, 1.0, 1.25, 2.0]),
       st.integers(0, 1000))
def test_capacity_mask_equals_the_loop(n_tokens, k, extra_experts, cf, seed):
    E = k + extra_experts
    g = torch.Generator().manual_seed(seed)
    skew = torch.linspace(2.0, 0.0, E)  # a skewed router, so that some experts overflow
    experts = (torch.randn(n_tokens, E, generator=g) + skew).topk(k, dim=-1).indices
    capacity = expert_capacity(n_tokens, k, E, cf)
    kept = capacity_mask(experts, E, cf)
    assert kept.tolist() == kept_by_a_loop(experts.tolist(), E, capacity)
    per_expert = torch.bincount(experts[kept], minlength=E)
    assert (per_expert <= capacity).all()
    assert (per_expert == torch.minimum(expert_counts(experts, E), torch.tensor(capacity))).all(), \
        "an expert is filled up to its capacity before anything is dropped"


def test_block_with_a_capacity_drops_exactly_the_assignments_past_it():
    block = moe_block(experts_per_token=2)
    with torch.no_grad():
        block.router.weight[1] += 2.0  # most tokens want expert 1
    block.capacity_factor = 1.0
    x = torch.randn(3, 6, 16).abs()
    with torch.no_grad():
        out = block(x)
        flat = x.reshape(-1, 16)
        kept = kept_by_a_loop(out.routing.experts.tolist(), 4, expert_capacity(18, 2, 4, 1.0))
        assert not all(all(row) for row in kept), "the test needs some assignments dropped"
        for n in range(flat.size(0)):  # one token at a time: the kept experts, the unrenormalised weights
            expected = torch.zeros(16)
            for w, e, keep in zip(out.routing.weights[n], out.routing.experts[n].tolist(), kept[n]):
                if keep:
                    expected = expected + w * block.experts[e](flat[n])
            torch.testing.assert_close(out.x.reshape(-1, 16)[n], expected, atol=1e-6, rtol=1e-5)


def test_a_capacity_of_every_token_is_the_dropless_block():
    block = moe_block(experts_per_token=2)
    with torch.no_grad():
        block.router.weight[1] += 5.0
        block.router.weight[3] += 4.0  # every token on experts 1 and 3
    x = torch.randn(2, 7, 16).abs()
    with torch.no_grad():
        dropless = block(x).x
        block.capacity_factor = 2.0  # E / k: an expert may take every token
        assert torch.equal(block(x).x, dropless)
        block.capacity_factor = 1.0
        assert not torch.allclose(block(x).x, dropless), "at 1.0 half the assignments to 1 and 3 are dropped"


@pytest.mark.parametrize("cf,match", [(0.0, r"capacity_factor must lie in \(0, inf\), got 0.0"),
                                      (-1.0, "capacity_factor must lie in"), (float("nan"), "must be a finite number"),
                                      (True, "must be a finite number")])
def test_capacity_factor_must_be_positive(cf, match):
    with pytest.raises(ValueError, match=match):
        MoEFeedForward(MOE, capacity_factor=cf)
    with pytest.raises(ValueError, match=match):
        capacity_mask(torch.zeros(3, 2, dtype=torch.long), 4, cf)
    with pytest.raises(ValueError, match=match):
        expert_capacity(3, 2, 4, cf)


def test_capacity_mask_refuses_bad_expert_indices():
    with pytest.raises(ValueError, match="must be an integer tensor"):
        capacity_mask(torch.zeros(3, 2), 4, 1.0)
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\], got values from 0 to 4"):
        capacity_mask(torch.tensor([[0, 4]]), 4, 1.0)
    with pytest.raises(ValueError, match=r"shape \(tokens, k\), got \(3,\)"):
        capacity_mask(torch.zeros(3, dtype=torch.long), 4, 1.0)
