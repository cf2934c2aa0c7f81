"""tutorial_lib.norm_order, the probes of notebooks 04 and 08b: per-layer gradient norms of matched pre-LN
and post-LN stacks at initialisation, and the warmup / learning-rate sweep."""

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from tutorial_lib.config import ModelConfig
from tutorial_lib.norm_order import (
    layer_gradient_norms,
    matched_stacks,
    norm_order_gradients,
    probe_inputs,
    warmup_sweep,
    xavier_init,
)
from tutorial_lib.positions import sinusoidal_table

CFG = ModelConfig(family="encoder", d_model=32, n_heads=4, n_layers=3, ffn="relu")


def test_xavier_init_follows_glorot_bounds_and_keeps_tied_tables():
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(50, 16), "lin": nn.Linear(16, 64), "norm": nn.LayerNorm(16)})
    tied = nn.Linear(16, 50, bias=False)
    tied.weight = model["emb"].weight
    model["tied"] = tied
    with torch.no_grad():
        model["norm"].weight.fill_(3.0)
    xavier_init(model)
    bound = math.sqrt(6 / (16 + 64))
    w = model["lin"].weight
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.01  # uniform(-a, a) has std a / sqrt(3)
    assert model["lin"].bias.abs().max() == 0 and (model["norm"].weight == 1).all()
    table = model["emb"].weight
    assert abs(table.std().item() - 16 ** -0.5) < 0.02, "embedding tables are N(0, 1/d)"
    assert model["tied"].weight is table and table.abs().max() > bound, "a tied table keeps N(0, 1/d)"


def test_matched_stacks_share_layer_weights_and_differ_only_in_norm_order():
    torch.manual_seed(0)
    pre, post = matched_stacks(CFG)
    pre_layers, post_layers = pre.layers.state_dict(), post.layers.state_dict()
    assert pre_layers.keys() == post_layers.keys()
    assert all(torch.equal(pre_layers[k], post_layers[k]) for k in pre_layers)
    assert isinstance(pre.final_norm, nn.LayerNorm) and isinstance(post.final_norm, nn.Identity)
    assert not pre.training and not post.training
    x = torch.randn(2, 5, 32)
    assert (pre(x).x - post(x).x).abs().max() > 0.1, "the orders compute different functions"
    with pytest.raises(ValueError, match="init must be one of"):
        matched_stacks(CFG, init="he")


def layernorm_backward(x, upstream, eps):
    """d loss / d x for y = LayerNorm(x) with scale 1 and shift 0, written out."""
    mu = x.mean(-1, keepdim=True)
    sigma = (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    x_hat = (x - mu) / sigma
    return (upstream - upstream.mean(-1, keepdim=True)
            - x_hat * (upstream * x_hat).mean(-1, keepdim=True)) / sigma


def test_gradient_norms_match_a_case_worked_out_by_hand():
    """Pre-LN stack whose branches start at zero (zero_init_out) and whose layers are copies of
    layer 0: the stream stays x, so every layer's W^2 gradient is g (x) h with g the final
    LayerNorm's backward of R / (B T) and h = relu(W^1 LN(x) + b^1), the same in every layer."""
    cfg = ModelConfig(family="encoder", d_model=16, n_heads=2, n_layers=3, ffn="relu", zero_init_out=True)
    torch.manual_seed(1)
    pre, _ = matched_stacks(cfg, init="config")
    with torch.no_grad():
        pre.layers[0].ffn.up.bias.normal_()  # make the hidden units depend on something
    for layer in pre.layers[1:]:
        layer.load_state_dict(pre.layers[0].state_dict())
    x = torch.randn(2, 5, 16)
    readout = torch.randn(2, 5, 16)
    norms = layer_gradient_norms(pre, x, readout)

    g = layernorm_backward(x, readout / 10, cfg.norm_eps)  # (B, T, d) gradient at the stream
    layer = pre.layers[0]
    h = torch.relu(layer.ffn.up(layer.ffn_sublayer.norm(x)))  # (B, T, d_ff)
    expected = torch.einsum("btd,btf->df", g, h).norm().item()
    torch.testing.assert_close(norms, torch.full((3,), expected, dtype=torch.float64), rtol=1e-4, atol=0)
    whole = layer_gradient_norms(pre, x, readout, parameter=None)
    assert (whole > norms).all(), "the whole layer includes W^2 and more"


def test_squared_norm_after_a_final_layernorm_is_nearly_constant_and_a_poor_probe():
    torch.manual_seed(0)
    pre, post = matched_stacks(CFG)
    x = torch.randn(4, 6, 32) * 3 + 1
    for stack in (pre, post):
        y = stack(x).x
        per_position = y.pow(2).sum(-1)  # ||LN(.)||^2 = d * var / (var + eps), whatever the input
        torch.testing.assert_close(per_position, torch.full_like(per_position, 32.0), rtol=1e-3, atol=0)
        squared = layer_gradient_norms(stack, x, "squared_norm")
        linear = layer_gradient_norms(stack, x, torch.randn(x.shape))
        assert squared.max() < 1e-3 * linear.min(), (squared, linear)


def test_probe_rejects_bad_inputs():
    pre, _ = matched_stacks(CFG)
    x = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="float input vectors"):
        layer_gradient_norms(pre, torch.zeros(2, 3, dtype=torch.long), x)
    with pytest.raises(ValueError, match="one direction per output"):
        layer_gradient_norms(pre, x, torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="no parameter 'ffn.w2'"):
        layer_gradient_norms(pre, x, x, parameter="ffn.w2")
    with pytest.raises(ValueError, match=r"depths\[0\] must be a positive int \(an int >= 1\), got 0"):
        norm_order_gradients(CFG, depths=(0,))


def test_probe_inputs_are_unit_variance_token_vectors_plus_sinusoidal_positions():
    g = torch.Generator().manual_seed(0)
    x = probe_inputs(64, 8, 32, vocab_size=16, generator=g)
    assert x.shape == (64, 8, 32)
    tokens = x - sinusoidal_table(8, 32)  # (B, T, d): rows of the token table
    assert abs(tokens.var().item() - 1.0) < 0.15
    distinct = torch.unique(tokens.reshape(-1, 32).round(decimals=4), dim=0)
    assert len(distinct) <= 16, "only vocab_size different token vectors"


def test_matched_probe_reproduces_the_depth_scaling_of_xiong_et_al():
    """Xiong et al. (2020), Theorem 1: at initialisation the gradient of the last layer's W^2 does
    not shrink with depth L for post-LN, and shrinks like 1/sqrt(L) for pre-LN; so with the same
    weights the post-LN stack's output-side gradients are the larger, more so the deeper it is.
    Also measured: pre-LN's first layers get larger gradients than its last (Shleifer et al., 2021)."""
    profiles = norm_order_gradients(CFG, (6, 24), trials=3, batch_size=4, seq_len=8, seed=0)
    assert [(p.order, p.depth) for p in profiles] == [("pre", 6), ("pre", 24), ("post", 6), ("post", 24)]
    last = {(p.order, p.depth): float(p.mean[-1]) for p in profiles}
    ratio_6, ratio_24 = last["post", 6] / last["pre", 6], last["post", 24] / last["pre", 24]
    assert ratio_24 > 2.5 and ratio_24 > 1.4 * ratio_6, (ratio_6, ratio_24)
    assert 0.35 < last["pre", 24] / last["pre", 6] < 0.75, "pre-LN: about 1/sqrt(4) = 0.5"
    assert 0.8 < last["post", 24] / last["post", 6] < 1.25, "post-LN: about independent of depth"
    pre_24 = profiles[1]
    assert pre_24.per_trial.shape == (3, 24) and pre_24.last_over_first < 0.5


def test_with_small_gpt2_style_init_both_profiles_are_flat():
    """The picture depends on the initialisation: with N(0, 0.02^2) weights the branches are tiny,
    both stacks stay close to the identity, and both gradient profiles are flat, with the same
    shape (their ratio is the same at every layer)."""
    profiles = norm_order_gradients(CFG, (12,), trials=2, batch_size=4, seq_len=8, init="config")
    pre, post = (p.mean for p in profiles)
    for profile in (pre, post):
        assert profile.max() / profile.min() < 1.25, profile
    ratio = post / pre
    assert ratio.max() / ratio.min() < 1.05, ratio


# ---- the warmup sweep ---------------------------------------------------------------------------


class Tagger(nn.Module):
    """A tiny stand-in model: embedding -> linear, with the norm order as an attribute."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.emb = nn.Embedding(6, 8)
        self.out = nn.Linear(8, 6)

    def forward(self, ids):
        return self.out(self.emb(ids))


def perm_batch(i):
    ids = torch.randint(0, 6, (16, 4), generator=torch.Generator().manual_seed(i))
    return ids, (ids + 1) % 6


def tag_loss(model, batch):
    ids, targets = batch
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def test_warmup_sweep_runs_every_combination_from_the_same_weights():
    starts = []

    def make_model(order):
        model = Tagger(order)
        starts.append(model.emb.weight.detach().clone())
        return model

    sweep = warmup_sweep(make_model, perm_batch, steps=30, lrs=[1e-4, 0.3], warmup_steps=10,
                         fail_loss=math.log(6) - 0.2, compute_loss=tag_loss)
    assert [(r.order, r.warmup_steps, r.lr) for r in sweep.runs] == [
        (o, w, lr) for o in ("pre", "post") for w in (0, 10) for lr in (1e-4, 0.3)]
    assert all(torch.equal(s, starts[0]) for s in starts), "every run must start from the same weights"
    slow, fast = sweep.run("pre", 0, 1e-4), sweep.run("pre", 0, 0.3)
    assert slow.failed and not slow.blew_up, "lr 1e-4 barely moves in 30 steps: still at chance"
    assert not fast.failed and fast.final_loss < 0.5
    assert fast.final_loss == pytest.approx(sum(fast.history.loss[-10:]) / 10)
    warm = sweep.run("pre", 10, 0.3)
    assert warm.history.lr[0] == pytest.approx(0.03) and warm.history.lr[-1] == pytest.approx(0.3)
    assert fast.history.lr[0] == pytest.approx(0.3)
    assert sweep.first_failure("pre", 0) == 1e-4 and sweep.first_failure("post", 10) == 1e-4
    assert "FAILED" in sweep.summary() and "post-LN, warmup 10" in sweep.summary()


def test_a_run_that_blows_up_is_recorded_as_failed_not_raised():
    def nan_after_three(i):
        ids, targets = perm_batch(i)
        return (ids, targets, i >= 3)

    def loss(model, batch):
        ids, targets, poison = batch
        value = tag_loss(model, (ids, targets))
        return value * float("nan") if poison else value

    sweep = warmup_sweep(Tagger, nan_after_three, steps=10, lrs=[0.1], warmup_steps=2, fail_loss=10.0,
                         orders=("post",), compute_loss=loss)
    run = sweep.run("post", 0, 0.1)
    assert run.blew_up and run.failed and run.final_loss == math.inf
    assert len(run.history.loss) == 3, "the history holds the steps before the blow-up"
    assert sweep.first_failure("post", 2) == 0.1
    assert "blew up" in sweep.summary()


def test_warmup_sweep_rejects_bad_arguments():
    kwargs = dict(steps=10, lrs=[1e-3], warmup_steps=2, fail_loss=1.0, compute_loss=tag_loss)
    with pytest.raises(ValueError, match="warmup_steps must be"):
        warmup_sweep(Tagger, perm_batch, **{**kwargs, "warmup_steps": 0})
    with pytest.raises(ValueError, match="positive learning rates"):
        warmup_sweep(Tagger, perm_batch, **{**kwargs, "lrs": [0.0]})
    with pytest.raises(ValueError, match="orders must be among"):
        warmup_sweep(Tagger, perm_batch, **kwargs, orders=("middle",))


# ---- their plots ---------------------------------------------------------------------------------


def test_probe_plots_have_titles_labels_and_one_line_per_series():
    import matplotlib.pyplot as plt

    from tutorial_lib.plotting import (
        draw_norm_orders,
        plot_gradient_profiles,
        plot_last_layer_vs_depth,
        plot_sweep_curves,
        plot_warmup_sweep,
    )

    profiles = norm_order_gradients(CFG, (2, 4), trials=2, batch_size=2, seq_len=4)
    axes = plot_gradient_profiles(profiles)
    assert [ax.get_title() for ax in axes] == ["2 layers", "4 layers"]
    assert all(len(ax.get_lines()) == 2 and ax.get_xlabel() for ax in axes) and axes[0].get_ylabel()
    assert list(axes[1].get_lines()[1].get_ydata()) == pytest.approx(profiles[3].mean.tolist())
    ax = plot_last_layer_vs_depth(profiles)
    assert len(ax.get_lines()) == 3 and ax.get_title() and ax.get_xlabel() and ax.get_ylabel()

    sweep = warmup_sweep(Tagger, perm_batch, steps=4, lrs=[1e-3, 1e-2], warmup_steps=2, fail_loss=1.0,
                         compute_loss=tag_loss, tail=2)
    ax = plot_warmup_sweep(sweep)
    assert len(ax.get_lines()) == 5 and ax.get_title() and ax.get_xlabel() == "peak learning rate"
    axes = plot_sweep_curves(sweep)
    assert all(len(a.get_lines()) == 3 and a.get_title() and a.get_ylabel() for a in axes.flat)
    post_left, pre_right = draw_norm_orders()
    assert "post-LN" in post_left.get_title() and "pre-LN" in pre_right.get_title()
    with pytest.raises(ValueError, match="need 2 axes"):
        draw_norm_orders(axes=[plt.gca()])
    with pytest.raises(ValueError, match="no gradient profiles"):
        plot_gradient_profiles([])


def test_log_axis_labels_thin_out_over_a_wide_range():
    import matplotlib.pyplot as plt

    from tutorial_lib.plotting import _plain_log_labels

    labels = {}
    for low, high in ((0.9, 11.0), (1.2, 4.7)):
        fig, ax = plt.subplots()
        ax.set_yscale("log")
        ax.set_ylim(low, high)
        _plain_log_labels(ax.yaxis)
        fig.canvas.draw()
        shown = [(value, text.get_text()) for minor in (False, True)
                 for value, text in zip(ax.get_yticks(minor=minor), ax.get_yticklabels(minor=minor))]
        labels[low, high] = {text for value, text in shown if low <= value <= high} - {""}
        plt.close(fig)
    assert labels[0.9, 11.0] == {"1", "2", "5", "10"}  # not 3, 4, 6, 7, 8, 9: they would crowd
    assert labels[1.2, 4.7] == {"2", "3", "4"}  # a narrow axis keeps every label it has


def test_probes_leave_the_callers_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    norm_order_gradients(CFG, (2,), trials=1, batch_size=2, seq_len=4)
    warmup_sweep(Tagger, perm_batch, steps=2, lrs=[1e-3], warmup_steps=1, fail_loss=1.0, compute_loss=tag_loss,
                 tail=1)
    assert torch.equal(torch.rand(3), expected)


def test_xavier_init_bounds_each_matrix_as_nn_transformer_does_and_zeroes_every_bias():
    from tutorial_lib.transformer import EncoderLayer

    torch.manual_seed(0)
    theirs = nn.Transformer(32, 4, 1, 1, 128, dropout=0.0, batch_first=True).encoder.layers[0]
    ours = xavier_init(EncoderLayer(replace(CFG, qkv_bias=True, out_bias=True, ffn_bias=True)))
    pairs = [(ours.attn.qkv.weight, theirs.self_attn.in_proj_weight),
             (ours.attn.out.weight, theirs.self_attn.out_proj.weight),
             (ours.ffn.up.weight, theirs.linear1.weight), (ours.ffn.down.weight, theirs.linear2.weight)]
    for a, b in pairs:
        assert a.shape == b.shape
        bound = math.sqrt(6 / sum(a.shape))
        for w in (a, b):
            assert 0.9 * bound < w.abs().max() <= bound
    assert ours.ffn.up.bias.abs().max() == 0 and ours.attn.qkv.bias.abs().max() == 0
    assert theirs.self_attn.in_proj_bias.abs().max() == 0, "PyTorch zeroes the attention biases too"
    assert theirs.linear1.bias.abs().max() > 0, "... but leaves the FFN biases at nn.Linear's default"
