"""Exercises of notebook 04 (the encoder): RMSNorm, a residual sublayer in both orders, the
parameter count of one block, mean pooling over real tokens, and BERT's MLM corruption."""

from __future__ import annotations

import torch
from torch import nn

from .core import Exercise, Mistake


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 04.rms_norm --------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rms_cases():
    g = _gen(41)
    cases = []
    for shape in ((2, 3, 8), (4, 6)):
        d = shape[-1]
        x = torch.randn(shape, generator=g) * 2 + 1  # a non-zero mean, so centring shows
        weight = torch.rand(d, generator=g) + 0.5
        cases.append((x, weight, 1e-6))
    small = torch.randn(3, 5, generator=_gen(42)) * 0.05  # mean square ~ eps: where eps's place shows
    cases.append((small, torch.ones(5), 1e-2))
    return cases


def _rms_eps_outside(x, weight, eps):
    return x / (x.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps) * weight


def _rms_centred(x, weight, eps):
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rms_no_root(x, weight, eps):
    return x / (x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rms_wrong_dim(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=0, keepdim=True) + eps) * weight


def _rms_no_weight(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# ---- 04.sublayer ----------------------------------------------------------------------------------

def sublayer(x, f, norm, order):
    """A residual sublayer: pre-LN x + f(norm(x)), post-LN norm(x + f(x))."""
    if order == "pre":
        return x + f(norm(x))
    return norm(x + f(x))


def _sublayer_cases():
    g = _gen(43)
    f, norm = nn.Linear(6, 6), nn.LayerNorm(6)
    with torch.no_grad():  # weights from our own generator, so grading leaves the global one alone
        f.weight.copy_(torch.randn(6, 6, generator=g) * 0.5)
        f.bias.copy_(torch.randn(6, generator=g))
        norm.weight.copy_(torch.rand(6, generator=g) + 0.5)
        norm.bias.copy_(torch.rand(6, generator=g) - 0.5)
    x = torch.randn(2, 4, 6, generator=g) * 2 + 0.5
    return [(x, f, norm, "pre"), (x, f, norm, "post")]


def _sublayer_swapped(x, f, norm, order):
    return sublayer(x, f, norm, "post" if order == "pre" else "pre")


def _sublayer_norm_on_residual(x, f, norm, order):
    if order == "pre":
        h = norm(x)
        return h + f(h)
    return norm(x + f(x))


def _sublayer_norm_on_branch(x, f, norm, order):
    if order == "pre":
        return x + f(norm(x))
    return x + norm(f(x))


def _sublayer_no_residual(x, f, norm, order):
    return f(norm(x)) if order == "pre" else norm(f(x))


# ---- 04.block_parameters -------------------------------------------------------------------------

def block_parameters(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
    """Parameters of one Transformer block: self-attention (W_Q, W_K, W_V, W_O), a feed-forward
    network (two matrices, or three when gated), and two norms (LayerNorm: scale and shift;
    RMSNorm: scale only)."""
    d = d_model
    attention = 4 * d * d + (4 * d if attn_bias else 0)
    gated = ffn in ("swiglu", "geglu")
    matrices = 3 if gated else 2
    ffn_params = matrices * d * d_ff + (((2 if gated else 1) * d_ff + d) if ffn_bias else 0)
    norms = 2 * (2 * d if norm == "layernorm" else d)
    return attention + ffn_params + norms


def _block_cases():
    # (d_model, d_ff, ffn, attn_bias, ffn_bias, norm); the first is the notebook's 12,576 block
    return [(32, 128, "gelu", False, True, "layernorm"),
            (64, 256, "relu", True, True, "layernorm"),
            (64, 172, "swiglu", False, False, "rmsnorm"),
            (48, 96, "geglu", True, True, "rmsnorm")]


def _block_no_norms(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
    return block_parameters(d_model, d_ff, ffn, attn_bias, ffn_bias, norm) - 2 * (
        2 * d_model if norm == "layernorm" else d_model)


def _block_gated_two_matrices(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
    return block_parameters(d_model, d_ff, "gelu", attn_bias, ffn_bias, norm)


def _block_no_biases(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
    return block_parameters(d_model, d_ff, ffn, False, False, norm)


def _block_rms_with_bias(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
    return block_parameters(d_model, d_ff, ffn, attn_bias, ffn_bias, "layernorm")


def _block_one_norm(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
    return block_parameters(d_model, d_ff, ffn, attn_bias, ffn_bias, norm) - (
        2 * d_model if norm == "layernorm" else d_model)


# ---- 04.mean_pool ---------------------------------------------------------------------------------

def mean_pool(x, keep):
    """Mean of x (B, T, d) over the positions where keep (B, T) is True -> (B, d)."""
    total = x.masked_fill(~keep[..., None], 0.0).sum(dim=1)
    return total / keep.sum(dim=1, keepdim=True)


def _pool_cases():
    g = _gen(45)
    x = torch.randn(3, 5, 4, generator=g) + 1.0
    keep = torch.arange(5)[None, :] < torch.tensor([5, 2, 3])[:, None]  # (B, T), right padding
    poisoned = x.clone()
    poisoned[~keep] = float("nan")  # what a padded position may hold after a masked softmax
    # left padding and gaps: the real positions need not come first, nor be contiguous
    scattered = torch.tensor([[False, False, True, True, True],
                              [True, False, True, False, True],
                              [False, True, True, False, False]])
    x2 = torch.randn(3, 5, 4, generator=g) - 0.5
    x2[~scattered] = float("nan")
    return [(x, keep), (poisoned, keep), (x2, scattered)]


def _pool_all_positions(x, keep):
    return x.mean(dim=1)


def _pool_multiplied_by_mask(x, keep):
    return (x * keep[..., None]).sum(dim=1) / keep.sum(dim=1, keepdim=True)


def _pool_divided_by_T(x, keep):
    return x.masked_fill(~keep[..., None], 0.0).sum(dim=1) / x.size(1)


def _pool_summed(x, keep):
    return x.masked_fill(~keep[..., None], 0.0).sum(dim=1)


def _pool_first_n(x, keep):
    lengths = keep.sum(dim=1).tolist()
    return torch.stack([x[b, :n].mean(dim=0) for b, n in enumerate(lengths)])


# ---- 04.mlm_corrupt -------------------------------------------------------------------------------

def mlm_corrupt(ids, select_u, action_u, random_ids, mask_id, special_ids):
    """BERT's corruption with the random draws given: a position that is not special is selected
    when select_u < 0.15; a selected position becomes mask_id when action_u < 0.8, random_ids
    when 0.8 <= action_u < 0.9, and stays otherwise. Returns (inputs, labels), labels = the
    original id at selected positions and -100 elsewhere."""
    eligible = ~torch.isin(ids, special_ids)
    selected = eligible & (select_u < 0.15)
    inputs = torch.where(selected & (action_u < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(selected & (action_u >= 0.8) & (action_u < 0.9), random_ids, inputs)
    labels = torch.where(selected, ids, torch.full_like(ids, -100))
    return inputs, labels


def _mlm_cases():
    cases = []
    for seed, (B, T) in ((46, (4, 30)), (47, (2, 50))):
        g = _gen(seed)
        ids = torch.randint(3, 20, (B, T), generator=g)
        ids[:, 0] = 1  # [CLS]
        ids[0, T - 6:] = 0  # padding
        select_u = torch.rand(B, T, generator=g) * 0.4  # plenty of selected positions
        select_u[0, T - 6:] = 0.0  # padding would be selected if nothing stopped it
        select_u[:, 0] = 0.0
        action_u = torch.rand(B, T, generator=g)
        random_ids = torch.randint(3, 20, (B, T), generator=g)
        cases.append((ids, select_u, action_u, random_ids, 2, torch.tensor([0, 1])))
    return cases


def _mlm_selects_specials(ids, select_u, action_u, random_ids, mask_id, special_ids):
    return mlm_corrupt(ids, select_u, action_u, random_ids, mask_id, torch.tensor([-1]))


def _mlm_labels_everywhere(ids, select_u, action_u, random_ids, mask_id, special_ids):
    inputs, _ = mlm_corrupt(ids, select_u, action_u, random_ids, mask_id, special_ids)
    return inputs, ids.clone()


def _mlm_mask_all_selected(ids, select_u, action_u, random_ids, mask_id, special_ids):
    return mlm_corrupt(ids, select_u, torch.zeros_like(action_u), random_ids, mask_id, special_ids)


def _mlm_unselected_corrupted(ids, select_u, action_u, random_ids, mask_id, special_ids):
    _, labels = mlm_corrupt(ids, select_u, action_u, random_ids, mask_id, special_ids)
    eligible = ~torch.isin(ids, special_ids)
    inputs = torch.where(eligible & (action_u < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(eligible & (action_u >= 0.8) & (action_u < 0.9), random_ids, inputs)
    return inputs, labels


EXERCISES = [
    Exercise(
        name="04.rms_norm",
        task="rms_norm(x, weight, eps): x / sqrt(mean(x^2) + eps) * weight over the last dimension "
             "(no mean subtracted, no bias).",
        cases=_rms_cases,
        reference=rms_norm,
        mistakes={
            "epsilon outside the square root": Mistake(
                _rms_eps_outside, "Add eps to the mean square, then take the root: sqrt(mean(x^2) + eps), "
                                  "as torch.nn.RMSNorm and LLaMA do."),
            "subtracted the mean (that is LayerNorm)": Mistake(
                _rms_centred, "RMSNorm does not centre: divide x itself by its root mean square."),
            "divided by the mean square, not its root": Mistake(
                _rms_no_root, "The scale is the *root* mean square: sqrt(mean(x^2) + eps)."),
            "averaged over the wrong dimension": Mistake(
                _rms_wrong_dim, "Each position is normalised on its own: the mean runs over the features, "
                                "dim=-1 with keepdim=True."),
            "forgot the learned scale": Mistake(
                _rms_no_weight, "Multiply by weight (one learned number per feature) at the end."),
        },
        forbidden=("rms_norm", "RMSNorm", "rms_norm_by_hand"),
    ),
    Exercise(
        name="04.sublayer",
        task="sublayer(x, f, norm, order): a residual sublayer around f; order 'pre' gives "
             "x + f(norm(x)), order 'post' gives norm(x + f(x)).",
        cases=_sublayer_cases,
        reference=sublayer,
        mistakes={
            "the two orders swapped": Mistake(
                _sublayer_swapped, "Pre-LN normalises the *input of the branch*; post-LN normalises the *sum*."),
            "pre-LN normalised the residual path too": Mistake(
                _sublayer_norm_on_residual, "In pre-LN the residual path carries x itself: x + f(norm(x)), "
                                            "not norm(x) + f(norm(x)). That untouched path is its point."),
            "post-LN normalised the branch instead of the sum": Mistake(
                _sublayer_norm_on_branch, "Post-LN adds first, then normalises: norm(x + f(x))."),
            "forgot the residual connection": Mistake(
                _sublayer_no_residual, "Add x back: the sublayer *writes into* the residual stream."),
        },
        forbidden=("Residual", "pre_ln", "post_ln"),
    ),
    Exercise(
        name="04.block_parameters",
        task="block_parameters(d_model, d_ff, ffn, attn_bias, ffn_bias, norm): the parameters of one "
             "block: attention (W_Q, W_K, W_V, W_O), the FFN ('relu'/'gelu': two matrices; 'swiglu'/'geglu': "
             "three), two norms ('layernorm': scale and shift; 'rmsnorm': scale only).",
        cases=_block_cases,
        reference=block_parameters,
        mistakes={
            "forgot the two norms": Mistake(
                _block_no_norms, "Each of the two sublayers has its own norm: 2 x (2d) for LayerNorm, "
                                 "2 x d for RMSNorm."),
            "counted a gated FFN with two matrices": Mistake(
                _block_gated_two_matrices, "SwiGLU and GeGLU have three d x d_ff matrices (gate, up, down) "
                                           "and, with biases, two d_ff-sized biases."),
            "forgot the biases": Mistake(
                _block_no_biases, "attn_bias adds 4d (Q, K, V and O); ffn_bias adds d_ff (d_ff twice when "
                                  "gated) plus d."),
            "gave RMSNorm a bias": Mistake(
                _block_rms_with_bias, "RMSNorm has a scale only: d parameters, not 2d."),
            "counted one norm instead of two": Mistake(
                _block_one_norm, "There is a norm in front of (pre-LN) or after (post-LN) *each* sublayer."),
        },
        forbidden=("ModelConfig", "TransformerBlock", "EncoderLayer", "expected_parameters", "count_parameters"),
    ),
    Exercise(
        name="04.mean_pool",
        task="mean_pool(x, keep): the mean of x (B, T, d) over the positions where keep (B, T) is True, "
             "shape (B, d); keep may be True anywhere (right or left padding, gaps), and whatever the other "
             "positions hold must not matter.",
        cases=_pool_cases,
        reference=mean_pool,
        mistakes={
            "averaged over the padding too": Mistake(
                _pool_all_positions, "Only real positions count: zero the padding, sum, divide by the "
                                     "number of real positions."),
            "multiplied by the mask (NaN in padding survives)": Mistake(
                _pool_multiplied_by_mask, "0 * NaN is NaN. Use x.masked_fill(~keep[..., None], 0) so "
                                          "padding cannot reach the sum whatever it holds."),
            "divided by T instead of the length": Mistake(
                _pool_divided_by_T, "Divide by keep.sum(dim=1, keepdim=True), the real length of each example."),
            "summed instead of averaged": Mistake(
                _pool_summed, "A sum grows with the length; divide it by the number of real positions."),
            "averaged the first n positions": Mistake(
                _pool_first_n, "The real positions need not come first (left padding) nor be contiguous: "
                               "select them with keep itself, not with a length."),
        },
        forbidden=("mean_pool",),
    ),
    Exercise(
        name="04.mlm_corrupt",
        task="mlm_corrupt(ids, select_u, action_u, random_ids, mask_id, special_ids): select positions "
             "not in special_ids with select_u < 0.15; of those, action_u < 0.8 -> mask_id, "
             "0.8 <= action_u < 0.9 -> random_ids, else keep. Return (inputs, labels) with labels = ids at "
             "selected positions and -100 elsewhere. ids, random_ids: int tensors (B, T); select_u, action_u: "
             "float tensors (B, T) in [0, 1); mask_id: an int; special_ids: a 1-D int tensor of ids (for "
             "torch.isin).",
        cases=_mlm_cases,
        reference=mlm_corrupt,
        mistakes={
            "selected padding and special tokens": Mistake(
                _mlm_selects_specials, "Leave out positions whose id is in special_ids (padding, [CLS]) "
                                       "before selecting: torch.isin(ids, special_ids)."),
            "labels at every position": Mistake(
                _mlm_labels_everywhere, "The loss looks only at selected positions: put -100 "
                                        "(ignore_index) everywhere else. Predicting an unchanged, visible "
                                        "token teaches copying."),
            "masked every selected position": Mistake(
                _mlm_mask_all_selected, "Only 80% become [MASK]; 10% get a random token and 10% stay, so "
                                        "the model must also judge tokens it can see."),
            "corrupted positions that were not selected": Mistake(
                _mlm_unselected_corrupted, "Apply mask/random only where the position was selected."),
        },
    ),
]
