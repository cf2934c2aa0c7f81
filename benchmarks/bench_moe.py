"""Forward + backward time of tutorial_lib's mixture-of-experts FFN against transformers'
Mixtral sparse-MoE block, same weights: 8 SwiGLU experts of width 896 (Mixtral's 3.5 d),
top-2, d=256, 512 tokens. Target: ratio (ours / transformers) <= 1.2.

    python benchmarks/bench_moe.py [--repeats 20] [--rounds 5] [--implementation grouped_mm eager]

transformers picks how its experts run from ``config._experts_implementation``:
``grouped_mm`` is what a MixtralForCausalLM gets by default (one grouped matrix product
over all experts), ``eager`` is its readable loop over experts (the same idea as ours). Each
is timed against ours in alternating rounds in one process, and the median round is reported,
so that a busy machine slows both alike. Before timing, the script checks that both give the
same output and the same router gradient.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from _machine import load, time_step

from tutorial_lib.config import LLAMA_TINY
from tutorial_lib.moe import MoEFeedForward


def mixtral_block(ours: MoEFeedForward, d: int, f: int, E: int, k: int, implementation: str):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=E,
                                        num_experts_per_tok=k, experts_implementation=implementation)
    theirs = MixtralSparseMoeBlock(config)
    with torch.no_grad():  # transformers keeps [gate; up] of each expert in one (E, 2f, d) tensor
        theirs.gate.weight.copy_(ours.router.weight)
        for e, expert in enumerate(ours.experts):
            theirs.experts.gate_up_proj[e].copy_(torch.cat([expert.gate.weight, expert.up.weight]))
            theirs.experts.down_proj[e].copy_(expert.down.weight)
    return theirs


def compare(ours: MoEFeedForward, theirs, x: torch.Tensor, repeats: int, rounds: int) -> tuple[float, float]:
    """Check that both give the same output and router gradient, then the median seconds of a
    forward+backward step of each, timed in alternating rounds."""
    out, expected = ours(x).x, theirs(x)
    assert torch.allclose(out, expected, atol=1e-5), "outputs differ from transformers"
    ours.zero_grad(), theirs.zero_grad()
    out.square().sum().backward()
    expected.square().sum().backward()
    assert torch.allclose(ours.router.weight.grad, theirs.gate.weight.grad, atol=1e-3, rtol=1e-3), \
        "router gradients differ from transformers"

    def step_ours():
        ours(x).x.square().sum().backward()

    def step_theirs():
        theirs(x).square().sum().backward()

    for step in (step_ours, step_theirs):  # warm-up
        time_step(step, 3)
    ours_t, theirs_t = [], []
    for _ in range(rounds):
        ours_t += time_step(step_ours, repeats)
        theirs_t += time_step(step_theirs, repeats)
    return statistics.median(ours_t), statistics.median(theirs_t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--implementation", nargs="+", default=["grouped_mm", "eager"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, d, f, E, k = 1, 512, 256, 896, 8, 2
    cfg = dataclasses.replace(LLAMA_TINY, d_model=d, n_heads=4, n_kv_heads=None, d_ff=f, n_experts=E,
                              experts_per_token=k)
    ours = MoEFeedForward(cfg)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(B, T, d, requires_grad=True)

    print(f"MoE forward+backward, {B * T} tokens, d={d}, {E} experts of width {f}, top-{k}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; {load()}")
    for implementation in args.implementation:
        theirs = mixtral_block(ours, d, f, E, k, implementation)
        a, b = compare(ours, theirs, x, args.repeats, args.rounds)
        print(f"  tutorial_lib MoEFeedForward        : {a * 1e3:7.2f} ms")
        print(f"  transformers MixtralSparseMoeBlock : {b * 1e3:7.2f} ms   (experts_implementation={implementation!r})")
        print(f"  ratio (ours / transformers)        : {a / b:7.3f}   target <= 1.2")
    print(load())


if __name__ == "__main__":
    main()
