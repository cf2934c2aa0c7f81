"""How long counting Llama-2-70B's parameters takes: from the config (tutorial_lib.params.
expected_parameters, integer arithmetic) against building the model on the meta device and
counting its tensors (DecoderOnlyLM + count_parameters; transformers' LlamaForCausalLM when
installed). Target: expected_parameters well under a millisecond.

    python benchmarks/bench_params.py [--repeats 2000]

All are timed in one process, median of alternating rounds, so a busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tutorial_lib.config import LLAMA2_70B
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.params import count_parameters, expected_parameters


def seconds_per_call(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def built_with_tutorial_lib() -> int:
    with torch.device("meta"):
        return count_parameters(DecoderOnlyLM(LLAMA2_70B))["total"]


def built_with_transformers():
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)

    def build() -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())

    return build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    candidates = {"expected_parameters(config)": (lambda: expected_parameters(LLAMA2_70B)["total"], args.repeats),
                  "DecoderOnlyLM on meta + count_parameters": (built_with_tutorial_lib, 3)}
    hf_build = built_with_transformers()
    if hf_build is not None:
        candidates["transformers LlamaForCausalLM on meta"] = (hf_build, 3)
    totals = {name: fn() for name, (fn, _) in candidates.items()}
    assert len(set(totals.values())) == 1, f"the counts disagree: {totals}"
    times = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, (fn, repeats) in candidates.items():
            times[name].append(seconds_per_call(fn, repeats))
    base = statistics.median(times["expected_parameters(config)"])
    print(f"Llama-2-70B: {next(iter(totals.values())):,} parameters, counted three ways\n")
    print(f"{'method':<45} {'time per count':>15} {'ratio':>10}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<45} {median * 1e3:>12.3f} ms {median / base:>9.0f}x")


if __name__ == "__main__":
    main()
