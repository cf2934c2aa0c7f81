"""Notebook 11's checkers reject plausible wrong answers that they do not name, and answers
that hand in the library's own function."""

import torch

from tutorial_lib.exercises import check
from tutorial_lib.exercises.core import WRONG
from tutorial_lib.quant import quantize


def test_unnamed_wrong_answers_are_rejected():
    def nibbles_reversed(packed):
        return torch.cat([packed & 0x0F, packed >> 4]).flip(0)

    def acceptance_q_over_p(p, q, token):
        residual = (p - q).clamp_min(0)
        return torch.clamp(q[token] / p[token], max=1.0), residual / residual.sum()

    for name, fn in (("11.q4_1_nibbles", nibbles_reversed), ("11.acceptance", acceptance_q_over_p)):
        result = check(name, fn)
        assert result.status == WRONG, f"{name}: {result}"


def test_the_q8_0_reference_is_ggml_bytes():
    g = torch.Generator().manual_seed(0)
    from tutorial_lib.exercises import reference
    for x in (torch.randn(32, generator=g), torch.randn(32, generator=g) * 1e-2):
        d, q = reference("11.q8_0_block")(x)
        stored = quantize(x[None], "Q8_0")[0]
        assert torch.equal(stored[2:].view(torch.int8), q)
        assert stored[:2].view(torch.float16).float() == d.half().float()


def test_handing_in_the_library_is_refused():
    def q8_0_block(x):
        b = quantize(x[None], "Q8_0")[0]
        return b[:2].view(torch.float16).float()[0], b[2:].view(torch.int8)

    result = check("11.q8_0_block", q8_0_block)
    assert result.status == WRONG and "quantize" in result.message, str(result)
