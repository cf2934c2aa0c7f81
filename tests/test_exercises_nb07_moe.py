"""The grader of 07.active_params (the parameters one token uses in a mixture of experts): its
written-out reference agrees with tutorial_lib.params on every case, each named mistake is
named, plausible wrong answers that no mistake describes are rejected, and answers that let a
library counter do the work are refused."""

from dataclasses import replace

import pytest

from tutorial_lib import params
from tutorial_lib.config import MIXTRAL_8X7B
from tutorial_lib.exercises import EXERCISES, check
from tutorial_lib.exercises.core import MISTAKE, PASSED, WRONG

NAME = "07.active_params"
EXERCISE = EXERCISES[NAME]


def test_reference_passes_and_agrees_with_the_library_on_every_case():
    assert check(NAME, EXERCISE.reference).status == PASSED
    for (cfg,) in EXERCISE.cases():
        counts = params.expected_parameters(cfg)
        assert EXERCISE.reference(cfg) == counts["active"] < counts["total"], cfg


def test_the_cases_cover_what_the_task_names():
    cases = [cfg for (cfg,) in EXERCISE.cases()]
    assert any(cfg.dense_layers for cfg in cases), "a config with dense layers"
    assert any(cfg.n_shared_experts for cfg in cases), "a config with shared experts"
    assert any(cfg.shared_dim != cfg.expert_dim for cfg in cases if cfg.n_shared_experts), "a wider shared expert"
    assert any(cfg.tie_embeddings for cfg in cases) and not all(cfg.tie_embeddings for cfg in cases)
    assert any(cfg.kv_heads < cfg.n_heads for cfg in cases), "grouped-query attention"
    assert any(cfg.experts_per_token == 1 for cfg in cases), "top-1 routing"
    assert EXERCISE.reference(MIXTRAL_8X7B) == 12_879_925_248, "Mixtral-8x7B's 12.9B active (Mistral AI, 2023)"


@pytest.mark.parametrize("label", list(EXERCISE.mistakes))
def test_every_named_mistake_is_named(label):
    result = check(NAME, EXERCISE.mistakes[label].fn)
    assert result.status == MISTAKE and f"'{label}'" in result.message, (label, str(result))


def _experts_without_gate(cfg):
    """Routed and shared experts counted with two matrices, as if they were not SwiGLU."""
    d = cfg.d_model
    wrong_by = len(cfg.moe_layers) * d * (cfg.experts_per_token * cfg.expert_dim
                                          + cfg.n_shared_experts * cfg.shared_dim)
    return EXERCISE.reference(cfg) - wrong_by


def _keys_and_values_with_every_head(cfg):
    """Grouped-query attention ignored: W_K and W_V counted d x d."""
    return EXERCISE.reference(replace(cfg, n_kv_heads=cfg.n_heads))


def _no_final_norm(cfg):
    return EXERCISE.reference(cfg) - cfg.d_model


@pytest.mark.parametrize("wrong", [_experts_without_gate, _keys_and_values_with_every_head, _no_final_norm])
def test_plausible_wrong_answers_that_no_mistake_names_are_rejected(wrong):
    result = check(NAME, wrong)
    assert result.status == WRONG and "case" in result.message, str(result)


def _with_expected_parameters(cfg):
    return params.expected_parameters(cfg)["active"]


def _with_active_parameters(cfg):
    return params.active_parameters(cfg)


def _from_the_flop_count(cfg):
    """The FLOP count holds 2 per active matrix entry (the head included): what it lacks is the
    norms, and the token table when the head is not tied to it."""
    norms = cfg.n_layers * 2 * cfg.d_model + cfg.d_model
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return params.flops_per_token(cfg, 1)["matmul"] // 2 + table + norms


@pytest.mark.parametrize("fn,used", [(_with_expected_parameters, "expected_parameters"),
                                     (_with_active_parameters, "active_parameters"),
                                     (_from_the_flop_count, "flops_per_token")])
def test_letting_a_library_counter_do_it_is_refused_with_its_name(fn, used):
    result = check(NAME, fn)
    assert result.status == WRONG and used in result.message, str(result)
