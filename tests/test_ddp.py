"""Data-parallel training: 2 processes with batch b follow the loss curve of 1 process with
batch 2b.

The tolerance, from the arithmetic: both runs start from the same weights and see the same
2b windows at every step, and DDP averages the two processes' gradients, so the update is the
gradient of the whole global batch in both runs. What differs is the order of float32
additions: one mean over 2bT per-token losses against the mean of two means over bT. Step 1
therefore agrees to a few units in the last place (float32 keeps 24 bits, about 6e-8 of the
value, and a loss near 4 has a last place of about 5e-7); later steps start from weights
that differ by such roundings, which training amplifies a little, step by step. We allow 1e-4
over 20 steps: 200 times the last place of the loss, and still a thousandth of what one real
difference does (one process with only b windows misses the loss by more than 1e-2).
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch

import tutorial_lib.ddp as ddp
from tutorial_lib.ddp import global_batch, launch, parse_args, run, shard

ARGS = ["--steps", "20", "--d_model", "32", "--n_layers", "2", "--n_heads", "2", "--block", "32",
        "--corpus_chars", "50000"]
B = 8
TOLERANCE = 1e-4


def test_shards_partition_the_global_batch_and_every_rank_draws_the_same_one():
    stream = torch.arange(1000)
    x, y = global_batch(stream, step=3, size=8, block=5, seed=0)
    again, _ = global_batch(stream, step=3, size=8, block=5, seed=0)
    assert torch.equal(x, again) and torch.equal(y, x + 1)
    assert not torch.equal(x, global_batch(stream, step=4, size=8, block=5, seed=0)[0])
    pieces = [shard((x, y), r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in pieces]), x) and pieces[1][0].shape == (4, 5)
    with pytest.raises(ValueError, match="does not split evenly over 3 processes"):
        shard((x, y), 0, 3)
    with pytest.raises(ValueError, match="--warmup"):
        parse_args(["--steps", "5", "--warmup", "5"])


@pytest.mark.multiprocess
def test_two_processes_with_batch_b_follow_one_process_with_batch_2b():
    two = launch(2, ARGS + ["--batch", str(B)], timeout=600)
    assert two["world_size"] == 2 and two["backend"] in ("gloo", "nccl") and two["global_batch"] == 2 * B
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the two processes ran
    try:
        one = run(parse_args(ARGS + ["--batch", str(2 * B)]))
        half = run(parse_args(ARGS + ["--batch", str(B)]))
    finally:
        torch.set_num_threads(threads)
    differences = [abs(a - b) for a, b in zip(one["loss"], two["loss"])]
    assert len(differences) == 20
    assert differences[0] < 1e-5, f"step 1 sees identical weights and data, yet differs by {differences[0]:.2e}"
    assert max(differences) < TOLERANCE, f"largest difference {max(differences):.2e} over {TOLERANCE:.0e}"
    # the control: half the data per step is a real difference, far outside the tolerance
    assert max(abs(a - b) for a, b in zip(one["loss"], half["loss"])) > 100 * TOLERANCE
    assert one["loss"][-1] < one["loss"][0] - 0.3, "the run should learn something in 20 steps"


class FakeRuns:
    """Stands in for subprocess.run: fails with the given stderr texts, then succeeds."""

    def __init__(self, failures):
        self.failures, self.calls = list(failures), 0

    def __call__(self, command, **kwargs):
        self.calls += 1
        if self.failures:
            return subprocess.CompletedProcess(command, 1, "", self.failures.pop(0))
        Path(command[command.index("--out") + 1]).write_text(json.dumps({"world_size": 2}))
        return subprocess.CompletedProcess(command, 0, "", "")


def test_launch_retries_a_failed_rendezvous_but_not_a_failed_run(monkeypatch):
    network = "torch.distributed.DistNetworkError: Address already in use"
    fake = FakeRuns([network])
    monkeypatch.setattr(ddp.subprocess, "run", fake)
    assert launch(2, ARGS) == {"world_size": 2} and fake.calls == 2
    fake = FakeRuns(["ValueError: --batch must be positive"])  # a real error: no second try
    monkeypatch.setattr(ddp.subprocess, "run", fake)
    with pytest.raises(RuntimeError, match="attempt 1 of 2"):
        launch(2, ARGS)
    assert fake.calls == 1
    fake = FakeRuns([network, network])  # still failing after the last attempt
    monkeypatch.setattr(ddp.subprocess, "run", fake)
    with pytest.raises(RuntimeError, match="Address already in use"):
        launch(2, ARGS)
    assert fake.calls == 2
    with pytest.raises(ValueError, match="attempts"):
        launch(2, ARGS, attempts=0)
