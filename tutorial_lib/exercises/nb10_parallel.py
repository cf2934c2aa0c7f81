"""Exercises of notebook 10 (scaling out): which rows of the fused Q/K/V matrix a
tensor-parallel rank holds, the bytes of a ring all-reduce, the activations tensor parallelism
all-reduces in a step, and the pipeline bubble. Answers are exact integers, lists of them, or
fractions."""

from __future__ import annotations

from .core import Exercise, Mistake

# ---- 10.qkv_rows: a tensor-parallel rank's rows of the fused [Q; K; V] weight ------------------


def qkv_rows(n_heads, n_kv_heads, head_dim, rank, world_size):
    """Rank r computes query heads r*h/N .. (r+1)*h/N - 1 and key/value heads
    r*h_kv/N .. (r+1)*h_kv/N - 1: its rows of Q, then of K, then of V."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    q_rows, kv_rows = q // world_size, kv // world_size
    mine = list(range(rank * q_rows, (rank + 1) * q_rows))  # its query heads
    mine += list(range(q + rank * kv_rows, q + (rank + 1) * kv_rows))  # its key heads
    mine += list(range(q + kv + rank * kv_rows, q + kv + (rank + 1) * kv_rows))  # its value heads
    return mine


def _qkv_cases():
    #       h, h_kv, d_k, rank, N
    return [(4, 4, 2, 0, 2),    # multi-head attention
            (4, 2, 2, 1, 2),    # grouped-query attention
            (8, 2, 3, 1, 2),
            (8, 4, 1, 3, 4),
            (6, 3, 2, 2, 3)]


def _qkv_contiguous(n_heads, n_kv_heads, head_dim, rank, world_size):
    rows = (n_heads + 2 * n_kv_heads) * head_dim // world_size
    return list(range(rank * rows, (rank + 1) * rows))


def _qkv_kv_as_query_heads(n_heads, n_kv_heads, head_dim, rank, world_size):
    return qkv_rows(n_heads, n_heads, head_dim, rank, world_size)


def _qkv_kv_whole(n_heads, n_kv_heads, head_dim, rank, world_size):
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    q_rows = q // world_size
    return list(range(rank * q_rows, (rank + 1) * q_rows)) + list(range(q, q + 2 * kv))


# ---- 10.allreduce_bytes: what one rank sends in a ring all-reduce ---------------------------------


def allreduce_bytes(n_values, bytes_per_value, world_size):
    """A ring all-reduce is a reduce-scatter (N - 1 steps, each sending one of N pieces) then an
    all-gather of the reduced pieces (N - 1 more): 2 (N - 1) / N of the tensor."""
    return 2 * (world_size - 1) * n_values * bytes_per_value // world_size


def _allreduce_cases():
    #       values, bytes, N
    return [(1000, 4, 2), (1024, 2, 4), (600, 4, 8), (10, 4, 1), (6_738_415_616, 2, 8)]


def _allreduce_half(n_values, bytes_per_value, world_size):
    return (world_size - 1) * n_values * bytes_per_value // world_size


def _allreduce_to_everyone(n_values, bytes_per_value, world_size):
    return (world_size - 1) * n_values * bytes_per_value


def _allreduce_twice_the_tensor(n_values, bytes_per_value, world_size):
    return 2 * n_values * bytes_per_value


# ---- 10.tp_step_bytes: what tensor parallelism all-reduces in one training step -------------------


def tp_step_bytes(n_layers, batch, seq_len, d_model, bytes_per_value):
    """Per block two all-reduces of the (B, T, d) activations forward (after attention's output
    projection and after the FFN's down matrix) and two backward (the gradients of the two
    sublayers' inputs); the embedding and the head are not split here."""
    return 4 * n_layers * batch * seq_len * d_model * bytes_per_value


def _tp_cases():
    #       L, B, T, d, bytes
    return [(2, 8, 16, 32, 4), (80, 1, 4096, 8192, 2), (4, 3, 7, 5, 4), (32, 2, 2048, 4096, 2)]


def _tp_forward_only(n_layers, batch, seq_len, d_model, bytes_per_value):
    return tp_step_bytes(n_layers, batch, seq_len, d_model, bytes_per_value) // 2


def _tp_one_per_block(n_layers, batch, seq_len, d_model, bytes_per_value):
    return tp_step_bytes(n_layers, batch, seq_len, d_model, bytes_per_value) // 4


def _tp_per_sequence(n_layers, batch, seq_len, d_model, bytes_per_value):
    return 4 * n_layers * seq_len * d_model * bytes_per_value


# ---- 10.bubble_fraction ------------------------------------------------------------------------------


def bubble_fraction(stages, microbatches):
    """M + S - 1 micro-batch slots per step, of which each stage works M: it waits S - 1."""
    return (stages - 1) / (microbatches + stages - 1)


def _bubble_cases():
    return [(2, 4), (4, 8), (8, 32), (1, 5), (4, 1), (4, 2)]  # (4, 2): fewer micro-batches than stages


def _bubble_against_compute(stages, microbatches):
    return (stages - 1) / microbatches


def _bubble_without_microbatches(stages, microbatches):
    return (stages - 1) / stages


def _bubble_one_over_m(stages, microbatches):
    return 1 / microbatches


EXERCISES = [
    Exercise(
        name="10.qkv_rows",
        task="qkv_rows(n_heads, n_kv_heads, head_dim, rank, world_size): the rows of the fused [Q; K; V] "
             "weight (Q: n_heads * head_dim rows, then K and V: n_kv_heads * head_dim each) that tensor-parallel "
             "rank `rank` of `world_size` holds when every rank computes whole heads: its query heads' rows, "
             "then its key heads' rows, then its value heads' rows, as a list of row indices.",
        cases=_qkv_cases,
        reference=qkv_rows,
        forbidden=("qkv_rows_by_rank",),
        mistakes={
            "split the fused matrix into contiguous parts": Mistake(
                _qkv_contiguous, "A plain column split of [Q; K; V] gives rank 0 all of Q's first rows and part of K: "
                                 "split Q, K and V each into N parts by heads, and give rank r part r of each."),
            "split K and V as if they had n_heads heads": Mistake(
                _qkv_kv_as_query_heads, "With grouped-query attention K and V have n_kv_heads heads each, so K "
                                        "starts at row n_heads * head_dim and has n_kv_heads * head_dim rows."),
            "kept K and V whole on every rank": Mistake(
                _qkv_kv_whole, "Every rank needs only the key/value heads its query heads read: its 1/N of K "
                               "and of V, not all of them."),
        },
    ),
    Exercise(
        name="10.allreduce_bytes",
        task="allreduce_bytes(n_values, bytes_per_value, world_size): the bytes one rank sends in a ring "
             "all-reduce of a tensor of n_values values over world_size ranks (n_values divides by world_size).",
        cases=_allreduce_cases,
        reference=allreduce_bytes,
        forbidden=("ring_bytes_sent", "expected_traffic"),
        mistakes={
            "counted only the reduce-scatter": Mistake(
                _allreduce_half, "After the reduce-scatter each rank holds 1/N of the sum; an all-gather must "
                                 "still send the reduced pieces around: another (N - 1) / N of the tensor."),
            "sent the whole tensor to every other rank": Mistake(
                _allreduce_to_everyone, "That is the naive all-to-all; the ring sends pieces of 1/N of the "
                                        "tensor, 2 (N - 1) of them."),
            "forgot the (N - 1) / N": Mistake(
                _allreduce_twice_the_tensor, "A rank never sends the piece it ends with: 2 (N - 1) pieces of "
                                             "1/N, so 2 (N - 1) / N of the tensor, and nothing for N = 1."),
        },
    ),
    Exercise(
        name="10.tp_step_bytes",
        task="tp_step_bytes(n_layers, batch, seq_len, d_model, bytes_per_value): the bytes each rank hands to "
             "all-reduces in one training step of Megatron-style tensor parallelism (the payload, not the ring's "
             "traffic), with the embedding and the head not split.",
        cases=_tp_cases,
        reference=tp_step_bytes,
        forbidden=("expected_traffic",),
        mistakes={
            "forward pass only": Mistake(
                _tp_forward_only, "The backward pass all-reduces too: the gradients of the inputs of attention "
                                  "and of the FFN are partial sums on every rank, two more per block."),
            "one all-reduce per block": Mistake(
                _tp_one_per_block, "Attention and the FFN each end with a row-parallel matrix: two all-reduces "
                                   "per block forward, and two backward."),
            "one sequence, not the batch": Mistake(
                _tp_per_sequence, "The activations all-reduced are (B, T, d): the whole batch, every position."),
        },
    ),
    Exercise(
        name="10.bubble_fraction",
        task="bubble_fraction(stages, microbatches): the share of a GPipe step that a stage waits, when every "
             "stage takes the same time per micro-batch and sending costs nothing.",
        cases=_bubble_cases,
        reference=bubble_fraction,
        forbidden=("bubble_fraction",),
        mistakes={
            "measured against the compute, not the step": Mistake(
                _bubble_against_compute, "(S - 1) / M is the idle time over the busy time (Narayanan et al., "
                                         "2021); the share of the step is (S - 1) / (M + S - 1)."),
            "forgot the micro-batches": Mistake(
                _bubble_without_microbatches, "(S - 1) / S is the bubble of one batch without micro-batches; "
                                              "M micro-batches fill the pipeline M times."),
            "1 / M": Mistake(
                _bubble_one_over_m, "The bubble grows with the number of stages: S - 1 slots of M + S - 1."),
        },
    ),
]
