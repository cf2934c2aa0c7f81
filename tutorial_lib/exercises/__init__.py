"""Graded exercises for every notebook.

In a notebook::

    from tutorial_lib.exercises import check, show_task
    show_task("01.attention")
    def attention(q, k, v, mask=None):
        raise NotImplementedError   # your code here
    check("01.attention", attention)

For teachers: ``solution("01.attention")`` prints the reference solution, and
``exercise_names()`` lists every exercise in curriculum order.
"""

from __future__ import annotations

from . import (
    nb01_attention,
    nb02_masks,
    nb03_positions,
    nb04_encoder,
    nb05_seq2seq,
    nb06_llm,
    nb07_params,
    nb08_training,
    nb09_real,
    nb10_parallel,
    nb11_laptop,
    nb12_finetuning,
)
from .core import Exercise, Mistake, Result, grade, same, source_of

_MODULES = [nb01_attention, nb02_masks, nb03_positions, nb04_encoder, nb05_seq2seq, nb06_llm, nb07_params,
            nb08_training, nb09_real, nb10_parallel, nb11_laptop, nb12_finetuning]
EXERCISES: dict[str, Exercise] = {ex.name: ex for module in _MODULES for ex in module.EXERCISES}


def _get(name: str) -> Exercise:
    if name not in EXERCISES:
        raise ValueError(f"no exercise named {name!r}; the exercises are {list(EXERCISES)}")
    return EXERCISES[name]


def exercise_names(notebook: str | None = None) -> list[str]:
    """Every exercise name, or those of one notebook (``"01"``)."""
    return [n for n in EXERCISES if notebook is None or n.startswith(f"{notebook}.")]


def check(name: str, fn) -> Result:
    """Grade the learner's function ``fn`` for exercise ``name``. Never raises for a wrong
    answer: the result says what is wrong, and a stub says "not attempted yet"."""
    return grade(_get(name), fn)


def task(name: str) -> str:
    return _get(name).task


class SourceCode(str):
    """Source code that a notebook shows as code, not as a quoted string with \\n in it."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_markdown_(self) -> str:
        return f"```python\n{self}\n```"


def solution(name: str) -> str:
    """The reference solution's source code, for teachers (a notebook cell shows it as code)."""
    return SourceCode(source_of(_get(name).reference))


def reference(name: str):
    """The reference solution as a function (tests call it)."""
    return _get(name).reference


__all__ = ["EXERCISES", "Exercise", "Mistake", "Result", "check", "exercise_names", "grade",
           "reference", "same", "solution", "task"]
