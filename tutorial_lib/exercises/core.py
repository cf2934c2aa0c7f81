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
    # How one case is run and what of it is compared: run(fn, args) -> the compared value.
    # None: fn(*args). An exercise whose answer must also behave right afterwards (losses that
    # backward() must accept) runs that here, for the reference and the mistakes alike.
    run: Callable[[Callable, tuple], object] | None = None


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
    """Equal values: tensors of equal shape within ``atol``, containers element by element.
    Never raises: values that cannot be compared are not the same."""
    try:
        return _same(a, b, atol)
    except Exception:  # e.g. a learner's object whose == raises, or tensors on two devices
        return False


def _same(a, b, atol: float) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.device != b.device or _kind(a.dtype) != _kind(b.dtype):
            return False
        if a.dtype == torch.bool:
            return bool(torch.equal(a, b))
        a, b = a.detach().double(), b.detach().double()
        return bool(torch.allclose(a, b, atol=atol, rtol=1e-4, equal_nan=True))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], atol) for k in a)
    if isinstance(b, int) and not isinstance(b, bool) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)  # a count or a size in bytes: exactly, not approximately
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= atol + 1e-4 * abs(float(b))
        except (TypeError, ValueError):
            return False
    return bool(a == b)


def _kind(dtype: torch.dtype) -> str:
    """bool, integer or floating: answers of another kind are wrong even when the numbers agree
    (ids as floats, a mask as 0/1 numbers); float32 against float64 is not."""
    if dtype == torch.bool:
        return "bool"
    return "floating" if dtype.is_floating_point or dtype.is_complex else "integer"


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype}){where}"
    if value is None:
        return "None (does the function end with a return statement?)"
    if inspect.isgenerator(value):
        return "a generator (a ( ... for ...) expression or a yield; build the tensor, e.g. with torch.stack([...]))"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"{type(value).__name__} {repr(value)[:60]}"


def _difference(got, expected, atol: float = 1e-5) -> str:
    """What is wrong with ``got``, in one sentence; never raises."""
    try:
        return _explain(got, expected, atol)
    except Exception:  # a learner's value that cannot even be described in detail
        return f"expected {_describe(expected)}, got {type(got).__name__}"


def _explain(got, expected, atol: float) -> str:
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.device != expected.device:
            return f"expected a tensor on {expected.device}, got one on {got.device} (return it on the inputs' device)"
        if _kind(got.dtype) != _kind(expected.dtype):
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        if got.dtype == torch.bool:
            wrong = got != expected
            where = tuple(int(i) for i in wrong.nonzero()[0])
            return f"{int(wrong.sum())} of {wrong.numel()} entries differ, the first at index {where}"
        got_d, expected_d = got.detach().double(), expected.detach().double()
        for name, bad in (("NaN", got_d.isnan() & ~expected_d.isnan()), ("inf", got_d.isinf() & ~expected_d.isinf())):
            if bad.any():
                where = tuple(int(i) for i in bad.nonzero()[0])
                return (f"the output holds {name} at index {where} ({int(bad.sum())} of {bad.numel()} entries), where "
                        f"{expected_d[where].item():.4g} was expected")
        diff = (got_d - expected_d).abs().nan_to_num(nan=0.0)
        where = tuple(int(i) for i in (diff == diff.max()).nonzero()[0])
        return (f"largest difference {diff.max().item():.3g} at index {where}: got {got_d[where].item():.4g}, "
                f"expected {expected_d[where].item():.4g}")
    if isinstance(expected, (tuple, list)) and isinstance(got, (tuple, list)) and len(got) == len(expected):
        for i, (g, e) in enumerate(zip(got, expected)):
            if not same(g, e, atol):
                return f"item {i}: {_explain(g, e, atol)}"
    return f"expected {_describe(expected)}, got {_describe(got)}"


def _run(fn: Callable, args: tuple, run: Callable | None = None):
    args = copy.deepcopy(args)
    return fn(*args) if run is None else run(fn, args)


def names_used(fn: Callable) -> set[str]:
    """The names ``fn``'s source reads (not those in its comments or strings, and not the
    ones it binds itself: its name, its parameters, its local variables, so that a learner's
    variable ``causal_mask`` is not taken for the library function); empty when the source
    cannot be read (a built-in, a function typed into a bare interpreter). Names reached as an
    attribute (``bpe.merge_pair``) or imported inside the function always count."""
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
    read, bound, reached = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.Attribute):
            reached.add(node.attr)  # F.scaled_dot_product_attention, bpe.merge_pair
        elif isinstance(node, ast.alias):
            reached.add(node.name.split(".")[-1])  # from ... import the_function
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bound.add(node.name)
    # a name reached through a module or an import is never the learner's own, even when their
    # function bears the same name (def merge_pair(...): return bpe.merge_pair(...))
    return (read - bound) | reached


def grade(exercise: Exercise, fn: Callable) -> Result:
    """Run ``fn`` on the exercise's cases and say what is right or wrong."""
    name = exercise.name
    own = [exercise.reference] + [mistake.fn for mistake in exercise.mistakes.values()]
    if exercise.forbidden and not any(fn is f for f in own):  # the course's own code may use them
        used = sorted(set(exercise.forbidden) & names_used(fn))
        if used:
            return Result(name, WRONG, f"your function uses {', '.join(used)}, which computes the answer for "
                                       "you; write it with basic tensor operations instead")
    if not callable(fn):
        return Result(name, WRONG, f"check takes your function itself (check({name!r}, my_function)), "
                                   f"got {_describe(fn)}")
    cases = exercise.cases()
    expected = [_run(exercise.reference, args, exercise.run) for args in cases]
    got = []
    for i, args in enumerate(cases):
        try:
            got.append(_run(fn, args, exercise.run))
        except NotImplementedError:
            return Result(name, NOT_ATTEMPTED, "not attempted yet: replace `raise NotImplementedError` "
                                               "with your code and run the cell again")
        except (Exception, SystemExit) as err:  # the learner's code failed: report, never stop the notebook
            return Result(name, ERROR, f"case {i} raised {type(err).__name__}: {err}")
    if all(same(g, e, exercise.atol) for g, e in zip(got, expected)):
        return Result(name, PASSED, f"correct on all {len(cases)} cases")
    for label, mistake in exercise.mistakes.items():
        try:
            theirs = [_run(mistake.fn, args, exercise.run) for args in cases]
        except Exception:  # a mistake that cannot run on some case is simply not this answer
            continue
        if all(same(g, t, exercise.atol) for g, t in zip(got, theirs)):
            return Result(name, MISTAKE, f"looks like '{label}'. {mistake.hint}")
    first = next(i for i, (g, e) in enumerate(zip(got, expected)) if not same(g, e, exercise.atol))
    return Result(name, WRONG, f"case {first}: {_difference(got[first], expected[first], exercise.atol)}")


def source_of(fn: Callable) -> str:
    return inspect.getsource(fn)
