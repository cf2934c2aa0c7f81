"""The shared integer checks of tutorial_lib.checks: what they accept, and messages that name the
argument, say what was expected and show what came."""

import re

import pytest

from tutorial_lib.checks import check_count, check_ignore_index, check_int


def message(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def test_check_count_returns_the_value_and_accepts_the_bounds_themselves():
    assert check_count("T", 1) == 1
    assert check_count("step", 0, 0) == 0
    assert check_count("k", 4, maximum=4) == 4
    assert check_count("low", 0, 0, below=10) == 0
    assert check_count("low", 9, 0, below=10) == 9
    assert check_count("keep", None, optional=True) is None


@pytest.mark.parametrize("call, expected", [
    (lambda: check_count("T", 0), "T must be a positive int (an int >= 1), got 0"),
    (lambda: check_count("step", -1, 0), "step must be a non-negative int (an int >= 0), got -1"),
    (lambda: check_count("n_classes", 1, 2), "n_classes must be an int >= 2, got 1"),
    (lambda: check_count("k", 5, maximum=4), "k must be an int in [1, 4], got 5"),
    (lambda: check_count("k", 0, maximum=4), "k must be an int in [1, 4], got 0"),
    (lambda: check_count("prefix_len", 5, 0, maximum=4, bound_name="T"),
     "prefix_len must be an int in [0, T=4], got 5"),
    (lambda: check_count("low", 10, 0, below=10, bound_name="vocab_size"),
     "low must be an int in [0, vocab_size=10), got 10"),
    (lambda: check_count("keep", 0, optional=True), "keep must be a positive int (an int >= 1) or None, got 0"),
    (lambda: check_count("sync_every", 0, why="steps between read-backs"),
     "sync_every must be a positive int (an int >= 1; steps between read-backs), got 0"),
    (lambda: check_count("vocab_size", 100, 258, why="256 bytes + 2 specials"),
     "vocab_size must be an int >= 258 (256 bytes + 2 specials), got 100"),
    (lambda: check_count("k", 9, maximum=8, why="the number of experts"),
     "k must be an int in [1, 8] (the number of experts), got 9"),
])
def test_check_count_says_what_was_expected_and_what_came(call, expected):
    assert message(call) == expected


@pytest.mark.parametrize("value, shown", [
    (3.0, "got 3.0 of type float (write int(3.0) or use //)"),  # 64 / 4 and the like
    (2.5, "got 2.5 of type float"),
    (True, "got True of type bool"),  # an int to Python, not a count
    ("3", "got '3' of type str"),
    (None, "got None of type NoneType"),
])
def test_check_count_refuses_what_is_not_an_int_by_its_type(value, shown):
    text = message(lambda: check_count("n_heads", value))
    assert text.startswith("n_heads must be a positive int (an int >= 1), ") and text.endswith(shown), text
    if value == 2.5:
        assert "int(2.5)" not in text, "no hint to write int() of a fraction"


def test_check_count_takes_one_upper_bound():
    with pytest.raises(ValueError, match="a maximum or a bound below, not both"):
        check_count("k", 2, maximum=4, below=5)


def test_check_count_builds_no_message_for_a_good_value():
    class Loud(int):  # an int that fails the test when a message is built from it
        def __format__(self, spec):
            raise AssertionError("formatted a value that passed")

        def __repr__(self):
            raise AssertionError("formatted a value that passed")

    assert check_count("T", Loud(3), maximum=Loud(4), bound_name="T") == 3


def test_check_int_takes_any_int_and_refuses_the_rest():
    assert check_int("pad_id", -100) == -100
    assert check_int("bos_id", None, optional=True) is None
    assert message(lambda: check_int("pad_id", 0.5, why="the token id to pad with")) == (
        "pad_id must be an int (the token id to pad with), got 0.5 of type float")
    assert message(lambda: check_int("eos_id", "2", optional=True)) == (
        "eos_id must be an int or None, got '2' of type str")
    assert re.search(r"got False of type bool$", message(lambda: check_int("i", False)))


def test_check_ignore_index_keeps_its_message():
    assert check_ignore_index(-100) == -100
    assert message(lambda: check_ignore_index(-100.0)).startswith(
        "ignore_index must be an int (the target value to skip), got -100.0 of type float")
