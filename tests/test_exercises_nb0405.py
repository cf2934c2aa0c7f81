"""The checkers of notebooks 04 and 05: each reference passes, each named mistake is named, a
plausible wrong answer that no mistake describes is still rejected, and an attempt that hands
the work to the library function the exercise rebuilds is refused."""

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib.exercises import EXERCISES, check
from tutorial_lib.exercises.core import MISTAKE, PASSED, WRONG

NAMES = [name for name in EXERCISES if name.startswith(("04.", "05."))]
MISTAKES = [(name, label) for name in NAMES for label in EXERCISES[name].mistakes]


def test_the_two_notebooks_have_their_exercises():
    assert sorted(NAMES) == ["04.block_parameters", "04.mean_pool", "04.mlm_corrupt", "04.rms_norm",
                             "04.sublayer", "05.beam_step", "05.greedy_decode", "05.sequence_log_prob",
                             "05.shift_right"]


@pytest.mark.parametrize("name", NAMES)
def test_reference_passes(name):
    result = check(name, EXERCISES[name].reference)
    assert result.status == PASSED, str(result)


@pytest.mark.parametrize("name,label", MISTAKES, ids=[f"{n}:{m}" for n, m in MISTAKES])
def test_each_named_mistake_is_named(name, label):
    result = check(name, EXERCISES[name].mistakes[label].fn)
    assert result.status == MISTAKE and f"'{label}'" in result.message, str(result)


# ---- plausible wrong answers that no named mistake describes -------------------------------------

def rms_by_l2_norm(x, weight, eps):
    return x / (x.norm(dim=-1, keepdim=True) + eps) * weight  # the L2 norm lacks the 1/sqrt(d)


def sublayer_pre_norm_after_branch(x, f, norm, order):
    return x + norm(f(x)) if order == "pre" else norm(x + f(x))


def block_one_bias_per_gated_matrix(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
    d = d_model
    matrices = 3 if ffn in ("swiglu", "geglu") else 2
    ffn_params = matrices * d * d_ff + (matrices * d_ff if ffn_bias else 0)  # down's bias has d, not d_ff
    return 4 * d * d + (4 * d if attn_bias else 0) + ffn_params + 2 * (2 * d if norm == "layernorm" else d)


def pool_divided_by_batch_total(x, keep):
    return x.masked_fill(~keep[..., None], 0.0).sum(dim=1) / keep.sum()


def mlm_random_and_unchanged_swapped(ids, select_u, action_u, random_ids, mask_id, special_ids):
    selected = ~torch.isin(ids, special_ids) & (select_u < 0.15)
    inputs = torch.where(selected & (action_u < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(selected & (action_u >= 0.9), random_ids, inputs)  # the wrong 10 %
    return inputs, torch.where(selected, ids, torch.full_like(ids, -100))


def shift_by_roll(tgt_out, bos_id):
    return torch.roll(tgt_out, 1, dims=1)  # the last token wraps round to where BOS belongs


def greedy_pads_over_eos(model, src, src_mask, max_len, bos_id, eos_id, pad_id):
    ids = torch.full((src.size(0), 1), bos_id, dtype=torch.long)
    finished = torch.zeros(src.size(0), dtype=torch.bool)
    for _ in range(max_len):
        next_id = model(src, ids, src_mask=src_mask).logits[:, -1].argmax(dim=-1)
        finished |= next_id == eos_id  # updated before padding: EOS itself becomes PAD
        ids = torch.cat([ids, next_id.masked_fill(finished, pad_id)[:, None]], dim=1)
    return ids[:, 1:]


def score_masked_by_decoder_input(model, src, src_mask, tgt_out, bos_id, pad_id):
    tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], bos_id), tgt_out[:, :-1]], dim=1)
    logp = model(src, tgt_in, src_mask=src_mask).logits.log_softmax(dim=-1)
    picked = logp.gather(2, tgt_out[..., None]).squeeze(2)
    return picked.masked_fill(tgt_in == pad_id, 0.0).sum(dim=1)  # counts the first PAD label


def beam_parent_by_k(beam_logp, logp, k):
    B, _, V = logp.shape
    scores, flat = (beam_logp[:, :, None] + logp).reshape(B, -1).topk(k, dim=-1)
    return scores, flat // k, flat % V  # the hypothesis is flat // V


UNNAMED_WRONG = {
    "04.rms_norm": rms_by_l2_norm,
    "04.sublayer": sublayer_pre_norm_after_branch,
    "04.block_parameters": block_one_bias_per_gated_matrix,
    "04.mean_pool": pool_divided_by_batch_total,
    "04.mlm_corrupt": mlm_random_and_unchanged_swapped,
    "05.shift_right": shift_by_roll,
    "05.greedy_decode": greedy_pads_over_eos,
    "05.sequence_log_prob": score_masked_by_decoder_input,
    "05.beam_step": beam_parent_by_k,
}


@pytest.mark.parametrize("name", NAMES)
def test_a_plausible_wrong_answer_that_no_mistake_names_is_rejected(name):
    result = check(name, UNNAMED_WRONG[name])
    assert result.status == WRONG, str(result)


def test_mean_pool_rejects_averaging_a_prefix_of_the_sequence():
    """The review's loophole: with right padding only, averaging x[b, :n] passed."""

    def prefix_mean(x, keep):
        return torch.stack([x[b, : int(keep[b].sum())].mean(dim=0) for b in range(x.size(0))])

    result = check("04.mean_pool", prefix_mean)
    assert result.status == MISTAKE and "first n positions" in result.message, str(result)


# ---- handing in the library's answer ------------------------------------------------------------

def test_calling_the_library_function_an_exercise_rebuilds_is_refused():
    from tutorial_lib.encoder_only import mean_pool
    from tutorial_lib.sampling import greedy_decode, sequence_log_prob

    def pooled(x, keep):
        return mean_pool(x, keep)

    def scored(model, src, src_mask, tgt_out, bos_id, pad_id):
        return sequence_log_prob(model, src, tgt_out, src_mask, bos_id=bos_id, pad_id=pad_id)

    def greedy(model, src, src_mask, max_len, bos_id, eos_id, pad_id):
        return greedy_decode(model, src, src_mask, max_len=max_len, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id).ids

    def my_rms_norm(x, weight, eps):
        return F.rms_norm(x, (x.size(-1),), weight, eps)

    for name, attempt, used in (("04.mean_pool", pooled, "mean_pool"), ("05.sequence_log_prob", scored,
                                "sequence_log_prob"), ("05.greedy_decode", greedy, "greedy_decode"),
                                ("04.rms_norm", my_rms_norm, "rms_norm")):
        result = check(name, attempt)
        assert result.status == WRONG and used in result.message, str(result)


def test_the_library_delegation_would_otherwise_pass():
    """Without the forbidden names these delegations give the right numbers: the refusal is
    what stops them, not a wrong value."""
    from tutorial_lib.exercises.core import grade
    from tutorial_lib.sampling import sequence_log_prob

    exercise = EXERCISES["05.sequence_log_prob"]
    for args in exercise.cases():
        model, src, src_mask, tgt_out, bos_id, pad_id = args
        got = sequence_log_prob(model, src, tgt_out, src_mask, bos_id=bos_id, pad_id=pad_id)
        torch.testing.assert_close(got, exercise.reference(*args), atol=1e-5, rtol=1e-4)
    assert grade(exercise, exercise.reference).status == PASSED


def test_block_parameters_may_not_build_a_block_and_count_it():
    def counted(d_model, d_ff, ffn, attn_bias, ffn_bias, norm):
        from tutorial_lib.config import ModelConfig
        from tutorial_lib.layers import TransformerBlock

        cfg = ModelConfig(family="encoder", d_model=d_model, n_heads=4, d_ff=d_ff, ffn=ffn, qkv_bias=attn_bias,
                          out_bias=attn_bias, ffn_bias=ffn_bias, norm=norm)
        return sum(p.numel() for p in TransformerBlock(cfg).parameters())

    result = check("04.block_parameters", counted)
    assert result.status == WRONG and "ModelConfig" in result.message, str(result)
