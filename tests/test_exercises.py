"""Every checker accepts its reference solution, names each of its mistakes, and reports a
stub as not attempted (without raising)."""

import types

import pytest

from tutorial_lib.exercises import EXERCISES, check, exercise_names, solution
from tutorial_lib.exercises.core import ERROR, MISTAKE, NOT_ATTEMPTED, PASSED, WRONG

MISTAKES = [(name, label) for name, ex in EXERCISES.items() for label in ex.mistakes]


@pytest.mark.parametrize("name", list(EXERCISES))
def test_reference_solution_passes(name):
    result = check(name, EXERCISES[name].reference)
    assert result.status == PASSED, str(result)


@pytest.mark.parametrize("name,label", MISTAKES, ids=[f"{n}:{m}" for n, m in MISTAKES])
def test_each_named_mistake_is_caught_and_named(name, label):
    result = check(name, EXERCISES[name].mistakes[label].fn)
    assert result.status == MISTAKE and f"'{label}'" in result.message, str(result)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_a_stub_is_not_attempted_yet(name):
    def stub(*args, **kwargs):
        raise NotImplementedError

    result = check(name, stub)
    assert result.status == NOT_ATTEMPTED and "not attempted yet" in str(result)


def test_other_errors_and_unknown_wrong_answers_are_reported_not_raised():
    def broken(*args):
        raise IndexError("oops")

    assert check("01.attention", broken).status == ERROR
    wrong = check("01.attention", lambda q, k, v, mask=None: v[..., :1, :].expand(*q.shape[:-1], v.size(-1)) * 0)
    assert wrong.status == WRONG and "case 0" in wrong.message


def test_every_notebook_from_01_has_at_least_three_exercises_and_solutions_are_reachable():
    notebooks = sorted({name.split(".")[0] for name in EXERCISES})
    assert "01" in notebooks
    for nb in notebooks:
        assert len(exercise_names(nb)) >= 3, f"notebook {nb} has {len(exercise_names(nb))} exercises"
    assert "def attention" in solution("01.attention")
    with pytest.raises(ValueError, match="no exercise named"):
        check("99.nothing", lambda: None)


def test_a_solution_shows_as_code_in_a_notebook():
    shown = solution("01.attention")
    assert repr(shown) == str(shown) and "\\n" not in repr(shown)  # no quoted one-liner
    assert shown._repr_markdown_().startswith("```python\n")


def test_an_attempt_that_calls_a_forbidden_name_is_wrong_and_the_name_is_given():
    from tutorial_lib.exercises.core import Exercise, grade

    exercise = Exercise("00.double", "double x", lambda: [(1,), (2,)], lambda x: 2 * x,
                        forbidden=("double_it",))

    def double_it(x):
        return x + x

    def delegates(x):
        return double_it(x)  # the forbidden helper

    def writes_it(x):
        # a comment that mentions double_it does not count
        return x * 2

    result = grade(exercise, delegates)
    assert result.status == WRONG and "double_it" in result.message, str(result)
    assert grade(exercise, writes_it).status == PASSED
    assert grade(exercise, lambda x: x * 2).status == PASSED  # a lambda's source is read too
    assert grade(exercise, double_it).status == PASSED  # a function may bear the name of what it rebuilds

    helpers = types.SimpleNamespace(double_it=double_it)

    def double_it_again(x):  # the same name as the forbidden one, but reaching the library's
        return helpers.double_it(x)

    double_it_again.__name__ = "double_it"
    result = grade(exercise, double_it_again)
    assert result.status == WRONG and "double_it" in result.message, str(result)
