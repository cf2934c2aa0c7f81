"""How a graded exercise works.

An :class:`Exercise` holds crafted inputs, a reference solution and the usual mistakes,
each written as a small wrong implementation with a hint. :func:`grade` runs the learner's
function on every input and compares with the reference; when the answer is wrong it looks
for the mistake whose outputs the learner's function reproduces and names it.
"""

from __future__ import annotations

import ast
import copy
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PASSED, NOT_ATTEMPTED, MISTAKE, WRONG, ERROR = "passed", "not attempted", "mistake", "wrong", "error"
_ICONS = {PASSED: "✅", NOT_ATTEMPTED: "⏳", MISTAKE: "❌", WRONG: "❌", ERROR: "💥"}


@dataclass(frozen=True)
class Mistake:
    """A usual mistake, as a wrong implementation, and what to tell the learner."""

    fn: Callable
    hint: str


@dataclass(frozen=True)
class Exercise:
    name: str
    task: str  # one sentence: what the learner's function must do
    cases: Callable[[], list[tuple]]  # fresh argument tuples on every call
    reference: Callable
    mistakes: dict[str, Mistake] = field(default_factory=dict)
    atol: float = 1e-5
    # Names whose use hands in the answer instead of writing it (the library function the
    # exercise rebuilds, a built-in that does the whole job). An attempt whose source uses one
    # is graded "wrong" with a message that names it; the reference and the mistakes may use them.
    forbidden: tuple[str, ...] = ()


@dataclass(frozen=True)
class Result:
    """The grade of one attempt; a notebook cell shows it as one line."""

    name: str
    status: str
    message: str

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __str__(self) -> str:
        return f"{_ICONS[self.status]} {self.name}: {self.message}"

    __repr__ = __str__


def same(a, b, atol: float = 1e-5) -> bool:
    """Equal values: tensors of equal shape within ``atol``, containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape:
            return False
        if a.dtype == torch.bool or b.dtype == torch.bool:
            return a.dtype == b.dtype and bool(torch.equal(a, b))
        if a.is_floating_point() != b.is_floating_point():
            return False  # integer ids against float values: a wrong dtype, whatever the values
        a, b = a.detach().double(), b.detach().double()
        return bool(torch.allclose(a, b, atol=atol, rtol=1e-4, equal_nan=True))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], atol) for k in a)
    if isinstance(b, int) and not isinstance(b, bool) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)  # a count or a size in bytes: exactly, not approximately
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= atol + 1e-4 * abs(float(b))
        except (TypeError, ValueError):
            return False
    return a == b


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} ({value.dtype})"
    return repr(value)[:80]


def _difference(got, expected, atol: float = 1e-5) -> str:
    if isinstance(got, (tuple, list)) and isinstance(expected, (tuple, list)) and len(got) == len(expected):
        first = next((i for i, (g, e) in enumerate(zip(got, expected)) if not same(g, e, atol)), None)
        if first is not None:
            return f"element {first}: {_difference(got[first], expected[first], atol)}"
    if isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor):
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.dtype != expected.dtype and (torch.bool in (got.dtype, expected.dtype)
                                            or got.is_floating_point() != expected.is_floating_point()):
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        g, e = got.detach().double(), expected.detach().double()
        nan = torch.isnan(g) != torch.isnan(e)
        if nan.any():
            where = tuple(int(i) for i in nan.nonzero()[0])
            return f"{'NaN' if torch.isnan(g[where]) else 'a number'} at index {where}, where " \
                   f"{'a number' if torch.isnan(g[where]) else 'NaN'} was expected"
        diff = (g - e).abs().nan_to_num(0.0)  # both NaN: no difference
        where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        return f"largest difference {diff.max().item():.3g} at index {where}"
    return f"expected {_describe(expected)}, got {_describe(got)}"


def _run(fn: Callable, args: tuple):
    return fn(*copy.deepcopy(args))


def names_used(fn: Callable) -> set[str]:
    """The names ``fn``'s source reads (not those in its comments or strings, and not the
    ones it binds itself: its name, its parameters, its local variables, so that a learner's
    variable ``causal_mask`` is not taken for the library function); empty when the source
    cannot be read (a built-in, a function typed into a bare interpreter)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return set()
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a lambda cut out of a longer expression: every identifier counts
        try:
            tokens = tokenize.generate_tokens(io.StringIO(source).readline)
            return {tok.string for tok in tokens if tok.type == tokenize.NAME}
        except (tokenize.TokenError, IndentationError, SyntaxError):
            return set()
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.Attribute):
            read.add(node.attr)  # F.scaled_dot_product_attention, masks.causal_mask
        elif isinstance(node, ast.alias):
            read.add(node.name.split(".")[-1])  # from ... import the_function
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bound.add(node.name)
    return read - bound


def grade(exercise: Exercise, fn: Callable) -> Result:
    """Run ``fn`` on the exercise's cases and say what is right or wrong."""
    name = exercise.name
    own = [exercise.reference] + [mistake.fn for mistake in exercise.mistakes.values()]
    if exercise.forbidden and not any(fn is f for f in own):  # the course's own code may use them
        # the learner's own function may share the name of the function it rebuilds
        used = sorted(set(exercise.forbidden) & (names_used(fn) - {getattr(fn, "__name__", "")}))
        if used:
            return Result(name, WRONG, f"your function uses {', '.join(used)}, which computes the answer for "
                                       "you; write it with basic tensor operations instead")
    cases = exercise.cases()
    expected = [_run(exercise.reference, args) for args in cases]
    got = []
    for i, args in enumerate(cases):
        try:
            got.append(_run(fn, args))
        except NotImplementedError:
            return Result(name, NOT_ATTEMPTED, "not attempted yet: replace `raise NotImplementedError` "
                                               "with your code and run the cell again")
        except Exception as err:  # the learner's code failed: report, never stop the notebook
            return Result(name, ERROR, f"case {i} raised {type(err).__name__}: {err}")
    if all(same(g, e, exercise.atol) for g, e in zip(got, expected)):
        return Result(name, PASSED, f"correct on all {len(cases)} cases")
    for label, mistake in exercise.mistakes.items():
        try:
            theirs = [_run(mistake.fn, args) for args in cases]
        except Exception:
            continue
        if all(same(g, t, exercise.atol) for g, t in zip(got, theirs)):
            return Result(name, MISTAKE, f"looks like '{label}'. {mistake.hint}")
    first = next(i for i, (g, e) in enumerate(zip(got, expected)) if not same(g, e, exercise.atol))
    return Result(name, WRONG, f"case {first}: {_difference(got[first], expected[first], exercise.atol)}")


def source_of(fn: Callable) -> str:
    return inspect.getsource(fn)
