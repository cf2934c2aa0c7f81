"""Greedy decoding with a real pretrained model at batch 1: the bundled SmolLM2-135M-Instruct
(tutorial_lib.pretrained.bundled_gguf, a Q4_1 GGUF file dequantized to float32) through
tutorial_lib's ``generate`` with the KV cache, by its default path (the model's own modules at
every step) and with ``fast=True`` (each one-token step as one function, FastDecoder), against
``transformers``' ``generate(do_sample=False)`` (its own cache) on the same float32 weights,
and both of ours again with the weight matrices stored column by column (see below).
Target: ours at least 1.25x as fast (printed as PASS or MISS for each path, not asserted).

    python benchmarks/bench_real_decode.py [--tokens 128] [--rounds 5] [--threads N]

Both sides load the same file: ours with ``load_pretrained(path)``, transformers with
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)``. The
prompt is a short chat built with our tokenizer's ``apply_chat_template``; neither side stops
at the end of a turn (no stop ids for ours; no EOS and ``min_new_tokens`` for transformers),
so both produce exactly ``--tokens`` tokens, and the script asserts that the ids are identical
in every round. After one short warm-up each, the two are timed in alternating rounds (the
order swapped each round) and the median of each is reported, as milliseconds per new token
(the time of the whole call, the prompt's prefill included, divided by the new tokens).

The memory-bound limit: at batch 1 a step reads every weight once and does two floating-point
operations per weight, so on a CPU it is bound by how fast the weights stream from memory.
The script counts the bytes of the distinct parameter tensors (the tied embedding/head matrix
once: the head multiplies by all of it at every step, while the embedding lookup reads one
row of it), measures this machine's read bandwidth (the sum of a 256 MiB float32 tensor, best
of several) and prints bytes / bandwidth as the lower bound on a step, and each side's time
as a multiple of it. The keys and values read from the cache are printed, not counted (about
1% of the weights at this context length). It also times the matrix-vector products alone
(one F.linear of a vector by each weight matrix, in the model's order): what a step costs
before anything but the products.

Where the time goes (torch.profiler, one step of each at 106 positions, 2 threads, an idle
2-core machine, 2026-12-01): about 89% of a step's self CPU time is aten::mm on both sides, and
it costs the same on both, matrix by matrix (SmolLM2's 576-wide rows stream through torch's
kernel at 14-15 GB/s, with one thread or two: 35-38 ms a token, far from the read bandwidth).
Attention is about 1 ms a step on both. The difference is the rest: ours runs a few hundred small
operations a step besides the products (3-5 ms); transformers runs more (separate q, k and v
products, a cache grown by torch.cat, dtype casts) and its generate adds work per token. So the
ratio is about (products + their rest) / (products + ours), 1.1-1.2x on an idle machine; a
1.25x lead needs faster products, not less overhead.

Faster products: the "column-major" paths hold the same weights stored column by column
(``tutorial_lib.memory_bound.column_major``: strides (1, out)), so that F.linear of one
vector runs as a product with a contiguous (in, out) matrix, which torch's CPU kernel streams
faster than the row-by-row dot products of the usual layout (1.2-1.5x per step in notebook 11
and in benchmarks/bench_decode_bits.py on this machine). The sums run in another order, so
the logits differ in their last bits; the script asserts that the tokens are still identical
to transformers' in every round. On a busy machine the timings say little:
with a neighbour on one core every 2-thread parallel region can wait a scheduler slice, and
the side with more such regions loses more (the ratio then swings from below 1 to above 3).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _machine import load, time_step

from tutorial_lib.memory_bound import column_major
from tutorial_lib.pretrained import bundled_gguf, load_pretrained
from tutorial_lib.sampling import GREEDY, generate

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WARM_UP_TOKENS = 8  # the warm-up runs every code path; the identity check is made in every timed round
BANDWIDTH_MB, BANDWIDTH_REPEATS = 256, 7
MB = 1e6  # bytes: decimal units throughout (MB, GB/s)


def weight_bytes(model: torch.nn.Module, table: torch.Tensor) -> dict[str, int]:
    """Bytes of the distinct parameter tensors (a tied matrix once, by storage), and of the
    token table and one of its rows."""
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for p in model.parameters():  # parameters() skips a repeated Parameter; the key, a shared storage
        seen[(p.untyped_storage().data_ptr(), p.storage_offset())] = p
    return {"total": sum(p.numel() * p.element_size() for p in seen.values()),
            "params": sum(p.numel() for p in seen.values()),
            "table": table.numel() * table.element_size(), "row": table.size(1) * table.element_size()}


def bandwidth() -> dict[str, float]:
    """Bytes per second on this machine: a read-only stream (the sum of a 256 MiB float32 tensor),
    a copy (bytes read + written) and torch.mv of a 256 MiB matrix (the kernel of a decode step;
    bytes of the matrix). Best of BANDWIDTH_REPEATS each, under the threads the benchmark uses."""
    n = BANDWIDTH_MB * 2**20 // 4
    x = torch.ones(n)
    y = torch.empty(n)
    matrix, vector = x.view(-1, 4096), torch.ones(4096)
    out = {}
    for name, step, moved in (("read", lambda: x.sum(), x.nbytes),
                              ("copy", lambda: y.copy_(x), 2 * x.nbytes),
                              ("mv", lambda: torch.mv(matrix, vector), x.nbytes)):
        step()  # first touch of the pages, outside the timing
        out[name] = moved / min(time_step(step, BANDWIDTH_REPEATS))
    return out


def matvec_floor(model: torch.nn.Module) -> tuple[float, int]:
    """(seconds, bytes) of one F.linear of a vector by each weight matrix of the model (the tied
    table once, as the head multiplies by it), in the model's order, best of BANDWIDTH_REPEATS:
    the products of a decode step and nothing else, through the kernel both sides call."""
    mats = [p for p in model.parameters() if p.dim() == 2]
    vectors = {W.size(1): torch.randn(1, W.size(1)) for W in mats}
    with torch.inference_mode():
        step = lambda: [F.linear(vectors[W.size(1)], W) for W in mats]
        step()
        return min(time_step(step, BANDWIDTH_REPEATS)), sum(W.nbytes for W in mats)


def load_transformers(path):
    """The transformers model of the same GGUF file in float32, its progress bar kept off the
    output (the GGUF converter's tqdm ignores disable_progress_bar); other stderr lines are
    passed on."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    caught = io.StringIO()
    with contextlib.redirect_stderr(caught):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    for line in caught.getvalue().replace("\r", "\n").splitlines():
        if line.strip() and "de-quantizing GGUF tensors" not in line:
            print(line, file=sys.stderr)
    model.generation_config.eos_token_id = None  # exactly the asked number of tokens, as ours
    return model, transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())  # pinned: the bandwidth and both sides
    start = time.perf_counter()

    path = bundled_gguf()
    ours, tokenizer, cfg = load_pretrained(path)
    theirs, hf_version = load_transformers(path)
    sizes = weight_bytes(ours, ours.embed.tokens.weight)
    theirs_total = weight_bytes(theirs, theirs.model.embed_tokens.weight)["total"]
    assert sizes["total"] == theirs_total, f"the models hold {sizes['total']:,} and {theirs_total:,} bytes of weights"
    assert ours.head.weight is ours.embed.tokens.weight, "SmolLM2 ties its head to the token table"
    prompt = torch.tensor([tokenizer.apply_chat_template(MESSAGES)])  # (1, T)
    mask = torch.ones_like(prompt)

    def run_ours(n: int) -> torch.Tensor:
        return generate(ours, prompt, n, sampler=GREEDY)  # no stop ids: n tokens

    def run_fast(n: int) -> torch.Tensor:
        return generate(ours, prompt, n, sampler=GREEDY, fast=True)

    columns = load_pretrained(path).model
    column_major(columns)  # the same values, each matrix stored column by column

    def run_columns(n: int) -> torch.Tensor:
        return generate(columns, prompt, n, sampler=GREEDY)

    def run_columns_fast(n: int) -> torch.Tensor:
        return generate(columns, prompt, n, sampler=GREEDY, fast=True)

    def run_hf(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return theirs.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, eos_token_id=None)

    speeds = bandwidth()
    floor_s, floor_bytes = matvec_floor(ours)
    runs = {"tutorial_lib generate (modules)": run_ours, "tutorial_lib generate(fast=True)": run_fast,
            "tutorial_lib modules, column-major": run_columns, "tutorial_lib fast=True, column-major": run_columns_fast,
            "transformers generate": run_hf}
    for run in runs.values():
        run(WARM_UP_TOKENS)
    times: dict = {name: [] for name in runs}
    for i in range(args.rounds):
        outputs = {}
        order = list(runs) if i % 2 == 0 else list(reversed(runs))  # alternating, so a busy spell hits all
        for name in order:
            t0 = time.perf_counter()
            outputs[name] = runs[name](args.tokens)
            times[name].append(time.perf_counter() - t0)
        b = outputs["transformers generate"]
        for name, a in outputs.items():
            assert a.shape == b.shape == (1, prompt.size(1) + args.tokens), (name, tuple(a.shape), tuple(b.shape))
            assert torch.equal(a, b), f"{name}: the tokens differ from position {int((a != b).nonzero()[0, 1])}"
    ms = {name: statistics.median(t) / args.tokens * 1e3 for name, t in times.items()}
    ms_hf = ms["transformers generate"]

    bound_ms = sizes["total"] / speeds["read"] * 1e3
    kv_per_position = 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * 4  # K and V, float32
    mean_context = prompt.size(1) + args.tokens / 2
    reply = tokenizer.decode(b[0, prompt.size(1):].tolist())
    print(f"greedy decoding of {args.tokens} new tokens after a {prompt.size(1)}-token chat prompt, batch 1, "
          f"{path.name} dequantized to float32 ({sizes['params']:,} parameters, {cfg.n_layers} layers, "
          f"d={cfg.d_model}), identical tokens in every round; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {hf_version}; median of {args.rounds} rounds after a warm-up")
    print(f"  reply begins: {reply[:60]!r}")
    for name, t in times.items():
        print(f"  {name:<37}: {ms[name]:7.1f} ms/token  ({statistics.median(t):5.2f} s; rounds "
              f"{', '.join(f'{x:.2f}' for x in t)})")
    best_hf = min(times["transformers generate"])
    for name in list(runs)[:4]:
        ratio = ms_hf / ms[name]
        verdict = "PASS" if ratio >= 1.25 else "MISS"
        print(f"  transformers / {name[13:]:<23}: {ratio:7.2f}x   target >= 1.25x  {verdict}"
              f"   (fastest rounds: {best_hf / min(times[name]):.2f}x; the slower rounds of a shared machine "
              "measure its neighbours too)")
    print("memory-bound limit")
    print(f"  weights read per token : {sizes['total'] / MB:7.1f} MB, every distinct parameter tensor once; the tied "
          f"{cfg.vocab_size} x {cfg.d_model} embedding/head matrix ({sizes['table'] / MB:.1f} MB) is counted once, "
          f"for the head, which reads all of it at every step (the embedding lookup reads one "
          f"{sizes['row'] / 1e3:.1f} kB row of it)")
    print(f"  KV cache read per token: {kv_per_position * mean_context / MB:7.1f} MB at the mean context of "
          f"{mean_context:.0f} positions ({kv_per_position / 1e3:.1f} kB a position; not counted)")
    print(f"  memory bandwidth       : {speeds['read'] / 1e9:7.1f} GB/s reading (sum of a {BANDWIDTH_MB} MiB float32 "
          f"tensor, best of {BANDWIDTH_REPEATS}); copy {speeds['copy'] / 1e9:.1f} GB/s (read + written), "
          f"torch.mv of a {BANDWIDTH_MB} MiB matrix {speeds['mv'] / 1e9:.1f} GB/s")
    print(f"  lower bound            : {bound_ms:7.1f} ms/token (weights / read bandwidth)")
    print(f"  matrix-vector products : {floor_s * 1e3:7.1f} ms/token, one F.linear of a vector by each of the "
          f"{floor_bytes / MB:.1f} MB of weight matrices and nothing else ({floor_bytes / floor_s / 1e9:.1f} GB/s: "
          "the kernel both sides run)")
    for name, m in ms.items():
        print(f"  {name:<37}: {m / bound_ms:7.2f}x the bound ({bound_ms / m:.0%} of the bandwidth-bound speed), "
              f"{m - bound_ms:5.1f} ms/token above it, {m - floor_s * 1e3:5.1f} above the products alone")
    print(f"{load()}; the script took {time.perf_counter() - start:.0f} s after its imports")


if __name__ == "__main__":
    main()
