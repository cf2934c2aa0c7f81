"""Notebook 10's checkers reject plausible wrong answers that they do not name (the shared tests
in test_exercises.py check the references and the named mistakes), and the references agree
with tutorial_lib.parallel, which the notebook's runs measured."""

from tutorial_lib import parallel as P
from tutorial_lib.exercises import check, reference
from tutorial_lib.exercises.core import PASSED, WRONG


def test_qkv_rows_rejects_the_rows_in_another_order_and_agrees_with_the_library():
    def kv_first(n_heads, n_kv_heads, head_dim, rank, world_size):  # the right rows, K and V before Q
        rows = reference("10.qkv_rows")(n_heads, n_kv_heads, head_dim, rank, world_size)
        q = n_heads * head_dim // world_size
        return rows[q:] + rows[:q]

    result = check("10.qkv_rows", kv_first)
    assert result.status == WRONG, str(result)
    for h, kv, d, N in [(4, 2, 2, 2), (8, 4, 3, 4), (6, 3, 1, 3)]:
        order = P.qkv_rows_by_rank(h, kv, d, N)
        for r in range(N):
            assert order.chunk(N)[r].tolist() == reference("10.qkv_rows")(h, kv, d, r, N), (h, kv, d, r, N)


def test_qkv_rows_rejects_a_call_of_the_library():
    def uses_library(n_heads, n_kv_heads, head_dim, rank, world_size):
        return P.qkv_rows_by_rank(n_heads, n_kv_heads, head_dim, world_size).chunk(world_size)[rank].tolist()

    result = check("10.qkv_rows", uses_library)
    assert result.status == WRONG and "qkv_rows_by_rank" in result.message, str(result)


def test_allreduce_bytes_rejects_the_received_bytes_counted_too_and_a_call_of_the_library():
    result = check("10.allreduce_bytes", lambda n, b, N: 4 * (N - 1) * n * b // N)
    assert result.status == WRONG, str(result)

    def delegates(n_values, bytes_per_value, world_size):  # right numbers, computed by the library
        return P.ring_bytes_sent("all_reduce", n_values * bytes_per_value, world_size)

    result = check("10.allreduce_bytes", delegates)
    assert result.status == WRONG and "ring_bytes_sent" in result.message, str(result)
    assert P.ring_bytes_sent("all_reduce", 1000 * 4, 2) == reference("10.allreduce_bytes")(1000, 4, 2)


def test_tp_step_bytes_rejects_the_ffn_width_in_place_of_the_model_width_and_a_call_of_the_library():
    result = check("10.tp_step_bytes", lambda L, B, T, d, b: 2 * L * B * T * (d + 4 * d) * b)
    assert result.status == WRONG, str(result)
    from tutorial_lib.config import ModelConfig

    def delegates(n_layers, batch, seq_len, d_model, bytes_per_value):
        cfg = ModelConfig(d_model=d_model, n_heads=1, n_layers=n_layers, vocab_size=8)
        return P.expected_traffic(cfg, "tp", 1, batch=batch, seq_len=seq_len, vocab_parallel=False,
                                  bytes_per_value=bytes_per_value)["all_reduce"]

    result = check("10.tp_step_bytes", delegates)
    assert result.status == WRONG and "expected_traffic" in result.message, str(result)

    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=3, vocab_size=64)
    formula = P.expected_traffic(cfg, "tp", 2, batch=8, seq_len=16, vocab_parallel=False)["all_reduce"]
    assert formula == reference("10.tp_step_bytes")(3, 8, 16, 32, 4)


def test_bubble_fraction_rejects_an_off_by_one_and_passes_a_different_correct_form():
    result = check("10.bubble_fraction", lambda S, M: (S - 1) / (M + S))
    assert result.status == WRONG, str(result)
    # right whenever M >= S or M = 1, wrong in between: the case (4 stages, 2 micro-batches) must catch it
    result = check("10.bubble_fraction", lambda S, M: (S - 1) / S if M < S else (S - 1) / (M + S - 1))
    assert result.status == WRONG, str(result)
    assert check("10.bubble_fraction", lambda S, M: 1 - M / (M + S - 1)).status == PASSED
    assert reference("10.bubble_fraction")(4, 12) == P.bubble_fraction(4, 12)
