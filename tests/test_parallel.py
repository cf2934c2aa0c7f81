"""Data, fully sharded, tensor and pipeline parallelism (tutorial_lib.parallel): the plans keep
the model's numbers, the counts from the config add up, and, in two processes (gloo on the
CPU), every scheme trains like one process on the same global batch while each rank holds
and sends exactly what the formulas say.

Tolerances, from the arithmetic. Both runs start from the same weights and see the same global
batch; only the order of float32 additions differs (sums split over ranks, partial sums of a
split matrix product, micro-batches). A loss near 4 has a last place of about 5e-7: over three
steps the losses agree to 1e-5. The weights are compared as a whole, ||w - w_ref|| against how
far training moved them, ||w_ref - w_0||, within 1e-4, and not weight by weight: the gradient of
the key projection's bias is zero in exact arithmetic (it adds the same number to every score
of a query, which the softmax cancels), so in float32 it is rounding noise of about 1e-11, and
AdamW divides it by its own running size plus eps = 1e-8 (eps dominates): those weights take
steps of about lr * 1e-3 that differ between any two orders of addition. One weight off by 6 %
of one learning-rate step would already break 1e-4 (the update norm is about 0.4 here).

The weights cannot see a gradient that is off by a constant factor on one tensor: AdamW divides
each gradient by its own running size, which removes most of the factor (a token table whose
gradient is halved moves the weights by about 2e-5 of the update, inside 1e-4). So every
step's gradients are compared too, tensor by tensor: ||g - g_ref|| / ||g_ref|| within 1e-4 for
every parameter tensor (float32 rounding gives less than 1e-5 here, 6e-6 at most, tensor
parallelism on GPT), where a factor of 2 on any tensor gives 0.5 or more.
`test_the_gradient_check_catches_a_tied_table_gradient_averaged` shows it: the pipeline with the
tied table's gradients averaged instead of summed passes the loss and weight checks and fails
this one.
"""

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from tutorial_lib import parallel as P
from tutorial_lib import parallel_by_hand as H
from tutorial_lib import parallel_runs as R
from tutorial_lib.config import ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.params import expected_parameters

LOSS_TOLERANCE, GRADIENT_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 1e-4, 1e-4


def small(flavour, **changes):
    cfg, _ = R.case_model(R.Case("ddp", flavour, n_layers=3, **changes))
    return cfg


# ---- without processes ----------------------------------------------------------------------------


def test_qkv_rows_by_rank_gives_each_rank_whole_heads_of_q_k_and_v():
    # 4 query heads and 2 key/value heads of width 2: Q rows 0-7, K rows 8-11, V rows 12-15
    order = P.qkv_rows_by_rank(n_heads=4, n_kv_heads=2, head_dim=2, degree=2)
    assert order[:8].tolist() == [0, 1, 2, 3, 8, 9, 12, 13], "rank 0: query heads 0-1, K head 0, V head 0"
    assert order[8:].tolist() == [4, 5, 6, 7, 10, 11, 14, 15], "rank 1: query heads 2-3, K head 1, V head 1"
    assert sorted(order.tolist()) == list(range(16)), "a permutation: every row exactly once"
    assert torch.equal(P.qkv_rows_by_rank(4, 4, 3, 1), torch.arange(36)), "one rank: the order is unchanged"
    with pytest.raises(ValueError, match="n_kv_heads=2 does not divide by 4"):
        P.qkv_rows_by_rank(n_heads=4, n_kv_heads=2, head_dim=2, degree=4)


def summed_over_ranks(attn, x, rows_of_rank, degree):
    """What tensor parallelism computes, simulated in one process: each rank takes its rows of
    the fused Q/K/V matrix and its columns of the output projection, attends with its own heads,
    and the partial outputs are summed (the all-reduce)."""
    total = 0
    for rank in range(degree):
        part = copy.deepcopy(attn)
        rows = rows_of_rank[rank]
        columns = slice(rank * attn.q_size // degree, (rank + 1) * attn.q_size // degree)
        part.qkv.weight.data = attn.qkv.weight.data[rows]
        if attn.qkv.bias is not None:
            part.qkv.bias.data = attn.qkv.bias.data[rows]
        part.out.weight.data = attn.out.weight.data[:, columns]
        if attn.out.bias is not None and rank > 0:
            part.out.bias.data.zero_()  # the bias is added once, not once per rank
        part.n_heads, part.n_kv_heads = attn.n_heads // degree, attn.n_kv_heads // degree
        part.q_size, part.kv_size = attn.q_size // degree, attn.kv_size // degree
        total = total + part(x, is_causal=True).out
    return total


@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_the_regrouped_rows_split_over_ranks_compute_the_whole_attention(flavour):
    torch.manual_seed(0)
    attn = DecoderOnlyLM(small(flavour)).blocks[0].attn
    x = torch.randn(2, 5, attn.d_model)
    whole = attn(x, is_causal=True).out
    order = P.qkv_rows_by_rank(attn.n_heads, attn.n_kv_heads, attn.head_dim, 2)
    split = summed_over_ranks(attn, x, order.chunk(2), 2)
    assert torch.allclose(split, whole, atol=1e-6), (split - whole).abs().max()
    # the control: a plain contiguous split of [Q; K; V] hands rank 0 all of Q and part of K
    plain = summed_over_ranks(attn, x, torch.arange(len(order)).chunk(2), 2)
    assert (plain - whole).abs().max() > 1e-3, "the plain split should compute something else"


def test_a_split_that_does_not_divide_is_refused_with_the_count_named():
    cfg = small("llama")  # 4 query heads, 2 key/value heads, d_ff 64, vocabulary 88
    P.check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match="n_kv_heads=2 does not divide by 4"):
        P.check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match="n_heads=4 does not divide by 3"):
        P.check_tensor_parallel(cfg, 3)
    odd_ffn = ModelConfig(d_model=32, n_heads=4, d_ff=66)
    with pytest.raises(ValueError, match="d_ff=66 does not divide by 4"):
        P.check_tensor_parallel(odd_ffn, 4)
    odd_vocab = ModelConfig(d_model=32, n_heads=4, vocab_size=86)
    with pytest.raises(ValueError, match="vocab_size=86 does not divide by 4"):
        P.check_tensor_parallel(odd_vocab, 4)
    P.check_tensor_parallel(odd_vocab, 2, vocab_parallel=True)
    P.check_tensor_parallel(ModelConfig(d_model=32, n_heads=4, vocab_size=87), 4, vocab_parallel=False)
    with pytest.raises(ValueError, match="positive int"):
        P.check_tensor_parallel(cfg, 0)


def test_the_tensor_and_pipeline_plans_refuse_what_they_do_not_split():
    moe = replace(small("llama"), n_experts=4, experts_per_token=2)
    with pytest.raises(ValueError, match="n_experts=4"):
        P.PipelineStageModule(DecoderOnlyLM(moe), 0, 2)
    relative = replace(small("gpt"), positions="relative")
    with pytest.raises(ValueError, match="relative-position table"):
        P.check_dense(relative, "tensor-parallel")
    P.check_dense(small("llama"), "pipeline")


def test_stage_layers_are_consecutive_and_as_equal_as_possible():
    assert P.stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert P.stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert P.stage_layers(3, 1) == [range(0, 3)]
    with pytest.raises(ValueError, match=r"stages must be an int in \[1, n_layers=2\], got 3"):
        P.stage_layers(2, 3)


@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_the_stages_in_sequence_are_the_whole_model_and_hold_what_the_count_says(flavour):
    cfg = small(flavour)
    torch.manual_seed(0)
    model = DecoderOnlyLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    stages = [P.PipelineStageModule(model, s, 2) for s in range(2)]
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(ids).logits), "stage 0 then stage 1 must compute the model's logits"
    names = dict(model.named_parameters())
    held = [dict(stage.named_parameters()) for stage in stages]
    for s, mine in enumerate(held):
        assert set(mine) <= set(names) | {"head.weight"}, "a stage keeps the whole model's names"
        assert sum(p.numel() for p in mine.values()) == P.rank_parameters(cfg, "pp", 2, s), s
    assert set(held[0]) | set(held[1]) >= set(names), "every parameter is on some stage"
    copies = expected_parameters(cfg)["embed.tokens"] if cfg.tie_embeddings else 0
    assert sum(P.rank_parameters(cfg, "pp", 2, s) for s in range(2)) == expected_parameters(cfg)["total"] + copies


def test_the_per_rank_counts_divide_the_model_as_each_scheme_does():
    for flavour in ("gpt", "llama"):
        cfg = small(flavour)
        total = expected_parameters(cfg)["total"]
        assert P.rank_parameters(cfg, "ddp", 2) == total
        assert P.rank_parameters(cfg, "fsdp", 4) * 4 == total
        # tensor parallelism, counted by hand from the built model: the split matrices' 1/N
        model = DecoderOnlyLM(cfg)
        split = sum(p.numel() for n, p in model.named_parameters()
                    if any(k in n for k in (".qkv.", ".out.weight", ".ffn.up.", ".ffn.gate.", ".ffn.down.weight",
                                            "embed.tokens", "head.")))
        assert P.rank_parameters(cfg, "tp", 2) == total - split + split // 2, flavour
        assert P.expected_memory(cfg, "tp", 2)["optimizer_states"] == 8 * P.rank_parameters(cfg, "tp", 2)
        assert P.expected_memory(cfg, "fsdp", 2)["gradients"] == 4 * total / 2
        # 2-D: tp's share within a pair, sharded again across the pairs
        assert P.rank_parameters(cfg, "fsdp_tp", 4) * 2 == P.rank_parameters(cfg, "tp", 2)
        assert P.rank_parameters(cfg, "fsdp_tp", 8) * 4 == P.rank_parameters(cfg, "tp", 2)


def test_the_two_d_mesh_needs_pairs_of_ranks():
    cfg = small("gpt")
    for world_size in (2, 3, 5):
        with pytest.raises(ValueError, match=f"at least 4, got {world_size}"):
            P.rank_parameters(cfg, "fsdp_tp", world_size)
    assert P.tp_pairs(4) == 2 and P.tp_pairs(8) == 4


def test_the_traffic_formulas_on_numbers_worked_by_hand():
    cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, max_len=4)  # GPT-like, tied
    total = expected_parameters(cfg)["total"]
    assert P.expected_traffic(cfg, "ddp", 2, batch=4, seq_len=4) == {"all_reduce": 4 * total}
    assert P.expected_traffic(cfg, "tp", 2, batch=4, seq_len=4, vocab_parallel=False) == {
        "all_reduce": 4 * 2 * (4 * 4 * 8 * 4)}  # 4 all-reduces per block of B x T x d floats
    first, last = (P.expected_traffic(cfg, "pp", 2, r, batch=4, seq_len=4) for r in (0, 1))
    assert first == last == {"send": 4 * 4 * 8 * 4, "all_reduce": 16 * 8 * 4}
    assert P.ring_bytes_sent("all_reduce", 100, 4) == 150
    assert P.ring_bytes_sent("all_gather", 100, 4) == 300 and P.ring_bytes_sent("reduce_scatter", 100, 4) == 75
    assert P.bubble_fraction(4, 12) == 3 / 15 and P.bubble_fraction(1, 5) == 0
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        P.bubble_fraction(2, 0)
    # interleaved 1F1B, v chunks per rank: the fill and drain slots are v times shorter
    assert P.bubble_fraction(4, 12, chunks=2) == 3 / 27 and P.bubble_fraction(2, 4, chunks=1) == 1 / 5
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        P.bubble_fraction(2, 4, chunks=0)
    # 2-D over 2 pairs: tp's all-reduces for half the batch; fsdp's traffic of tp's piece, across 2
    tp_piece, half = P.rank_parameters(cfg, "tp", 2, vocab_parallel=False), P.expected_traffic(
        cfg, "tp", 2, batch=2, seq_len=4, vocab_parallel=False)
    split = (".qkv.", ".out.weight", ".ffn.up.", ".ffn.gate.", ".ffn.down.weight")  # halved; the rest whole
    blocks = sum(p.numel() // 2 if any(k in n for k in split) else p.numel()
                 for n, p in DecoderOnlyLM(cfg).named_parameters() if n.startswith("blocks."))
    assert P.expected_traffic(cfg, "fsdp_tp", 4, batch=4, seq_len=4, vocab_parallel=False) == {
        **half, "all_gather": (tp_piece + blocks) * 4 / 2, "reduce_scatter": tp_piece * 4}
    with pytest.raises(ValueError, match="scheme must be one of"):
        P.expected_traffic(cfg, "zero", 2, batch=4, seq_len=4)


def test_bad_cases_are_refused():
    with pytest.raises(ValueError, match="scheme must be one of"):
        R.Case("zero3")
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        R.Case("pp", batch=8, microbatches=3)
    with pytest.raises(ValueError, match="flavour"):
        R.Case("tp", flavour="bert")
    with pytest.raises(ValueError, match="non-empty list of Case"):
        R.launch_cases([])
    with pytest.raises(ValueError, match="tied_reduce must be one of"):
        R.Case("pp", tied_reduce="max")
    with pytest.raises(ValueError, match="reduce must be 'sum' or 'mean', got 'avg'"):
        P.sync_tied_embedding(None, None, "avg")


def test_compare_sees_a_constant_factor_on_one_gradient_that_the_weights_do_not_show():
    """compare() without processes: the same reference, once as is and once with one tensor's
    gradient halved at one step, the weights untouched."""
    reference = R.train_one_process(R.Case("ddp", "llama", n_layers=2, steps=2))
    same = [{"loss": reference["loss"], "weights": reference["weights"], "gradients": reference["gradients"]}]
    assert R.compare(same, reference)["gradients"] == 0 and R.compare(same, reference)["weights_relative"] == 0
    halved = [dict(g) for g in reference["gradients"]]
    halved[1]["blocks.1.ffn.up.weight"] = halved[1]["blocks.1.ffn.up.weight"] / 2
    difference = R.compare([dict(same[0], gradients=halved)], reference)
    assert difference["gradients_worst"] == "blocks.1.ffn.up.weight", difference
    assert abs(difference["gradients"] - 0.5) < 1e-6 and difference["weights_relative"] == 0, difference
    with pytest.raises(ValueError, match="gradients of 1 steps, the reference of 2"):
        R.compare([dict(same[0], gradients=halved[:1])], reference)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_counter_sees_collectives_their_payload_and_nothing_else(one_process_group):
    x = torch.ones(10)
    with P.CommCounter() as counter:
        y = (x * 2).sum()  # computation: not counted
        dist.all_reduce(x)
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=0)
        funcol.wait_tensor(funcol.all_reduce(torch.ones(5), "sum", dist.group.WORLD))  # how DTensor communicates
    assert y.item() == 20
    assert counter.summary() == {"calls": {"all_reduce": 2, "broadcast": 1},
                                 "bytes": {"all_reduce": 40 + 20, "broadcast": 24}}, counter.summary()
    dist.all_reduce(x)
    assert counter.calls["all_reduce"] == 2, "nothing is counted after the context closes"


# ---- in two processes --------------------------------------------------------------------------------

CASES = [R.Case(scheme, flavour, n_layers=2) for flavour in ("gpt", "llama") for scheme in ("ddp", "fsdp", "tp", "pp")]
CASES += [R.Case("pp", "gpt", n_layers=2, schedule="1f1b"), R.Case("tp", "llama", n_layers=2, vocab_parallel=False)]
AVERAGED_TIED = R.Case("pp", "gpt", n_layers=2, tied_reduce="mean")  # the mistake the gradient check must catch
CASES += [AVERAGED_TIED]


@pytest.fixture(scope="module")
def runs():
    """Every case in one launch of two processes (starting them costs seconds), with the
    one-process reference of each."""
    return [(case, ranks, R.train_one_process(case)) for case, ranks in zip(CASES, R.launch_cases(CASES))]


def check_like_one_process(case, ranks, reference):
    difference = R.compare(ranks, reference)
    assert difference["loss"] < LOSS_TOLERANCE, (case, difference)
    assert difference["gradients"] < GRADIENT_TOLERANCE, (case, difference)
    assert difference["weights_relative"] < WEIGHT_TOLERANCE, (case, difference)
    assert reference["loss"][-1] < reference["loss"][0], "three steps should lower the loss"
    for r in ranks:
        assert r["memory"] == r["expected_memory"], (case, r["rank"], r["memory"], r["expected_memory"])
        sent = {kind: n for kind, n in r["traffic"]["bytes"].items() if kind != "recv"}
        assert sent == r["expected_traffic"], (case, r["rank"], sent, r["expected_traffic"])


def cases_of(runs, scheme):
    found = [run for run in runs if run[0].scheme == scheme and run[0] != AVERAGED_TIED]
    assert found, scheme
    return found


@pytest.mark.multiprocess
def test_ddp_in_two_processes_trains_like_one_process(runs):
    for case, ranks, reference in cases_of(runs, "ddp"):
        check_like_one_process(case, ranks, reference)
        assert all(r["traffic"]["calls"] == {"all_reduce": 1} for r in ranks), "one bucket of gradients"


@pytest.mark.multiprocess
def test_fsdp_in_two_processes_trains_like_one_process(runs):
    for case, ranks, reference in cases_of(runs, "fsdp"):
        check_like_one_process(case, ranks, reference)
        L = case.n_layers
        # the outer unit gathered once, every block twice (forward, backward); one reduce-scatter each
        assert all(r["traffic"]["calls"] == {"all_gather": 1 + 2 * L, "reduce_scatter": 1 + L} for r in ranks)
        assert ranks[0]["memory"]["weights"] * 2 == 4 * expected_parameters(R.case_model(case)[0])["total"]


@pytest.mark.multiprocess
def test_tensor_parallelism_in_two_processes_trains_like_one_process(runs):
    found = cases_of(runs, "tp")
    assert {(c.flavour, c.vocab_parallel) for c, _, _ in found} == {("gpt", True), ("llama", True), ("llama", False)}
    for case, ranks, reference in found:
        check_like_one_process(case, ranks, reference)
        per_block = 4 * case.n_layers  # two forward, two backward
        extra = 2 + 3 if case.vocab_parallel else 0  # embedding, head input, three for the loss
        assert all(r["traffic"]["calls"] == {"all_reduce": per_block + extra} for r in ranks), case


@pytest.mark.multiprocess
def test_pipeline_parallelism_in_two_processes_trains_like_one_process(runs):
    found = cases_of(runs, "pp")
    assert {(c.flavour, c.schedule) for c, _, _ in found} == {("gpt", "gpipe"), ("llama", "gpipe"), ("gpt", "1f1b")}
    for case, ranks, reference in found:
        check_like_one_process(case, ranks, reference)
        M = case.microbatches
        assert all(r["traffic"]["calls"]["send"] == M for r in ranks), "one message per micro-batch and boundary"
        held = [r["pipeline"]["steps"][-1]["in_flight"] for r in ranks]
        assert held == ([M, M] if case.schedule == "gpipe" else [2, 1]), (case.schedule, held)
        weights = ranks[0]["weights"]
        if case.flavour == "gpt":  # tied: the last stage's copy of the table stayed equal to the first's
            assert torch.equal(weights["head.weight"], weights["embed.tokens.weight"])


@pytest.mark.multiprocess
def test_the_checks_fail_for_a_run_on_other_data(runs):
    """The control: a one-process run that saw only the first half of every global batch (what
    one data-parallel rank sees) differs by far more than the tolerances."""
    case, ranks, _ = cases_of(runs, "ddp")[0]
    half = R.train_one_process(R.Case("ddp", case.flavour, n_layers=case.n_layers, batch=case.batch // 2))
    difference = R.compare(ranks, half)
    assert difference["loss"] > 100 * LOSS_TOLERANCE and difference["weights_relative"] > 100 * WEIGHT_TOLERANCE, (
        difference)
    assert difference["gradients"] > 100 * GRADIENT_TOLERANCE, difference


@pytest.mark.multiprocess
def test_the_gradient_check_catches_a_tied_table_gradient_averaged(runs):
    """The pipeline of a tied GPT that averages its two copies' gradients of the token table
    instead of summing them (ReduceOp.AVG, the data-parallel habit) gives that table half its
    gradient at every step. AdamW hides it: the losses and the weights stay within the
    tolerances. The tensor-by-tensor gradient check names the table, off by one half."""
    [(case, ranks, reference)] = [run for run in runs if run[0] == AVERAGED_TIED]
    difference = R.compare(ranks, reference)
    assert difference["loss"] < LOSS_TOLERANCE and difference["weights_relative"] < WEIGHT_TOLERANCE, (
        "AdamW should hide the halved gradient from the losses and the weights", difference)
    assert difference["gradients_worst"] == "embed.tokens.weight", difference
    assert abs(difference["gradients"] - 0.5) < 1e-3, ("the table's gradient should be half the true one", difference)
    assert difference["gradients"] > 1000 * GRADIENT_TOLERANCE, difference


TWO_D = [R.Case("fsdp_tp", flavour, n_layers=2) for flavour in ("gpt", "llama")]


@pytest.mark.multiprocess
def test_fsdp_across_tensor_parallel_pairs_in_four_processes_trains_like_one_process():
    """The 2-D mesh: two pairs of ranks, tensor parallelism within each pair, FSDP across them;
    every count of bytes held and handed to collectives equals its formula."""
    for case, ranks in zip(TWO_D, R.launch_cases(TWO_D, nproc=4)):
        check_like_one_process(case, ranks, R.train_one_process(case))
        L = case.n_layers
        calls = {"all_gather": 1 + 2 * L, "reduce_scatter": 1 + L, "all_reduce": 4 * L + 2 + 3}
        assert all(r["traffic"]["calls"] == calls for r in ranks), [r["traffic"]["calls"] for r in ranks]
        cfg = R.case_model(case)[0]
        assert ranks[0]["memory"]["weights"] * 2 == 4 * P.rank_parameters(cfg, "tp", 2), "half of a tp rank's piece"


# ---- the collectives and the split layers written by hand (tutorial_lib.parallel_by_hand) ----------


def test_the_by_hand_layers_in_one_process_are_plain_linear_layers():
    t, ref = H.layers(), H.one_process()
    assert torch.allclose(ref["column"], torch.nn.functional.linear(t["x"], t["w1"], t["b1"]))
    assert ref["ffn"].shape == (H.BATCH, H.D_OUT) and not torch.allclose(ref["ffn"], H.one_process(seed=1)["ffn"])


@pytest.mark.multiprocess
def test_collectives_and_split_layers_by_hand_in_two_processes():
    ranks = H.launch_by_hand(2)
    ref = H.one_process()
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        c = r["collectives"]
        assert c["all_reduce"] == [10.0, 12.0, 14.0, 16.0], c  # [0, 1, 2, 3] + [10, 11, 12, 13]
        assert c["all_gather"] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0], c
        assert c["reduce_scatter"] == [[10.0, 12.0], [14.0, 16.0]][r["rank"]], c
        assert r["held"] == {"w1": [H.D_HIDDEN // 2, H.D_IN], "w2": [H.D_OUT, H.D_HIDDEN // 2]}, r["held"]
        for key in ("column", "row", "ffn"):
            assert torch.allclose(r[key], ref[key], rtol=1e-5, atol=1e-5), (key, (r[key] - ref[key]).abs().max())
    # each rank's partial sum alone is not the output, and the two add up to it (with the bias once)
    partials = [r["row_partial"] for r in ranks]
    assert all((p - ref["row"]).abs().max() > 0.1 for p in partials)
    assert torch.allclose(partials[0] + partials[1] + H.layers()["b2"], ref["row"], atol=1e-5)
