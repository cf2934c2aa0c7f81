"""Batch-1 decoding of the bundled SmolLM2-135M-Instruct with float32, bfloat16 and 4-bit weights,
printed beside the weight bytes each step reads and this machine's memory bandwidth.
Target: the 4-bit path at least 2x the float32 path (PASS or MISS, not asserted), and no slower
than llama.cpp where ``llama-cpp-python`` is installed (an optional reference, never in CI).

    python benchmarks/bench_decode_bits.py [--tokens 64] [--rounds 5] [--threads N]

The paths, all through ``tutorial_lib.sampling.generate`` (the model's own modules, KV cache):

* float32: ``load_pretrained(bundled_gguf())``, the file's Q4_1 blocks dequantized;
* float32, column-major: the same values with every matrix stored column by column
  (``memory_bound.column_major``), which torch's matrix-vector kernel streams faster here;
* bfloat16: the model cast with ``.bfloat16()`` (half the bytes, activations in bf16 too);
* 4-bit: ``quant_linear.int4_from_gguf``: every linear layer on PyTorch's int4 CPU kernel from
  the file's own Q4_1 bytes, the head (the Q8_0 token table) on its int8 kernel.

llama.cpp, where installed: ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF"
pip install llama-cpp-python`` builds it from source (about 15 minutes on 2 cores; a native
build crashed while decoding on the course's machine). It decodes the same file greedily.

Each runs the same chat prompt for ``--tokens`` new tokens (no stop ids); after a warm-up the
paths are timed in alternating rounds (the order reversed every round) and the median round is
reported in ms per new token (the prefill included, as a user waits for it). The float32 paths
must produce the same tokens; the others are compared with float32 and the number of leading
tokens they share is printed (bf16 roundings change a near-tie sooner or later).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
from _machine import load

from tutorial_lib.memory_bound import column_major, read_bandwidth, weight_bytes
from tutorial_lib.pretrained import bundled_gguf, load_pretrained
from tutorial_lib.quant_linear import int4_from_gguf
from tutorial_lib.sampling import generate

MESSAGES = [{"role": "user", "content": "Give three reasons why the sky is blue."}]


def llama_cpp_ms(path, prompt: list[int], tokens: int, threads: int) -> float | None:
    """ms per token of llama.cpp decoding the same file greedily, or None when it is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)
    def run():
        n = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == tokens:
                break
    run()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / tokens * 1e3


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    differ = (a != b).nonzero()
    return a.numel() if differ.numel() == 0 else int(differ[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    start = time.perf_counter()
    path = bundled_gguf()
    f32, tokenizer, cfg = load_pretrained(path)
    columns, _, _ = load_pretrained(path)
    column_major(columns)
    bf16 = load_pretrained(path).model.bfloat16()
    int4, _, _ = load_pretrained(path)
    int4_from_gguf(int4, path)
    models = {"float32": f32, "float32, column-major": columns, "bfloat16": bf16, "4-bit (int4, int8 head)": int4}
    prompt = torch.tensor([tokenizer.apply_chat_template(MESSAGES)])  # (1, T)

    for model in models.values():
        generate(model, prompt, 4)  # warm-up
    times = {name: [] for name in models}
    outputs = {}
    for i in range(args.rounds):
        for name in (list(models) if i % 2 == 0 else list(reversed(models))):
            t0 = time.perf_counter()
            outputs[name] = generate(models[name], prompt, args.tokens)[0, prompt.size(1):]
            times[name].append(time.perf_counter() - t0)
    assert torch.equal(outputs["float32"], outputs["float32, column-major"]), "the two float32 layouts differ"
    ms = {name: statistics.median(t) / args.tokens * 1e3 for name, t in times.items()}
    bandwidth = read_bandwidth()
    cpp = llama_cpp_ms(path, prompt[0].tolist(), args.tokens, torch.get_num_threads())

    print(f"greedy decoding of {args.tokens} tokens after a {prompt.size(1)}-token chat prompt, batch 1, "
          f"{path.name}; {torch.get_num_threads()} threads, torch {torch.__version__}; median of "
          f"{args.rounds} alternating rounds")
    print(f"  memory bandwidth (sum of a 256 MiB tensor, best of 7): {bandwidth / 1e9:.1f} GB/s")
    print(f"  {'weights':<26} {'MB/token':>9} {'bound ms':>9} {'ms/token':>9} {'x bound':>8}  "
          "tokens shared with float32")
    for name, model in models.items():
        nbytes = weight_bytes(model)
        bound = nbytes / bandwidth * 1e3
        shared = shared_prefix(outputs[name], outputs["float32"])
        print(f"  {name:<26} {nbytes / 1e6:9.1f} {bound:9.2f} {ms[name]:9.1f} {ms[name] / bound:8.1f}  "
              f"{shared} of {args.tokens}")
    ratio = ms["float32"] / ms["4-bit (int4, int8 head)"]
    print(f"  4-bit / float32 speed-up: {ratio:.2f}x   target >= 2x  {'PASS' if ratio >= 2 else 'MISS'}")
    print(f"  float32 column-major / row-major speed-up: {ms['float32'] / ms['float32, column-major']:.2f}x")
    if cpp is None:
        print("  llama.cpp: llama-cpp-python is not installed (see this script's docstring); no comparison made")
    else:
        verdict = "PASS" if ms["4-bit (int4, int8 head)"] <= cpp else "MISS"
        print(f"  llama.cpp (llama-cpp-python, the same Q4_1 file): {cpp:.1f} ms/token; 4-bit path / llama.cpp "
              f"{cpp / ms['4-bit (int4, int8 head)']:.2f}x   target >= 1x  {verdict}")
    print(f"  reply (float32): {tokenizer.decode(outputs['float32'].tolist())[:70]!r}")
    print(f"{load()}; the script took {time.perf_counter() - start:.0f} s after its imports")


if __name__ == "__main__":
    main()
