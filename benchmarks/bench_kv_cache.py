"""KV-cache decoding against recomputing the whole context at every step, and against
``transformers``' ``generate``: 512 new tokens from a 16-token prompt, greedy, with
``tutorial_lib.sampling.generate`` on the tiny GPT and LLaMA presets, at batch 1 and batch 8,
in two ways with the cache: the default, every step through the model's modules, and
``fast=True``, every one-token step through ``tutorial_lib.fast_decode.FastDecoder``; and
recomputing (use_cache=False). Targets (issue 18), for each cached way: >= 10x recomputing;
at batch 1 at most 0.5 ms per token for the tiny GPT, and >= 2x ``transformers``' ``generate``
(its own cache) with identical tokens.

    python benchmarks/bench_kv_cache.py [--new-tokens 512] [--batch 1 8] [--rounds 3] [--threads N]

The presets' context (max_len=128) is raised to 1024 so that all 528 positions fit in one
window: past max_len, generate crops the context and refills the cache at every step, and
the cache no longer saves anything (notebook 06, section 5, shows why). Each model is built
as the ``transformers`` model of the preset's shape (GPT2LMHeadModel, LlamaForCausalLM, random
weights from seed 0) and converted (tutorial_lib.convert.from_hf_model), so all three paths
run the same weights; the script checks that they produce the same tokens before it prints a
ratio. They are timed in alternating rounds (the order rotated each round) and the fastest
round of each is reported (on a shared machine the slower rounds measure the neighbours).

At batch 1 a cached step of these tiny models is about 20 matrix-vector products and a few
hundred small operations, well under a millisecond: what it costs is mostly fixed per-call
overhead (Python, PyTorch's dispatch), not arithmetic. Through the modules a step makes about
50 module calls, each with its checks, closures and named tuples; FastDecoder runs the same
operations on the same weights without them, which is what the "fast=True / modules" line
measures. LLaMA's step has more small operations than GPT's (RoPE, a third FFN matrix), and
its RMSNorm costs more than GPT's LayerNorm: on a CPU torch's ``rms_norm`` is a composite of
about eight small operations, LayerNorm one kernel (FastDecoder runs those operations written
out, ``tutorial_lib.fast_decode.rms_norm_steps``; benchmarks/bench_norms.py times the three).
At batch 8 the recomputation's arithmetic grows eightfold while a cached step barely changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from _machine import load

from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.convert import from_hf_model
from tutorial_lib.data import CharTokenizer, builtin_corpus
from tutorial_lib.sampling import GREEDY, generate

PROMPT_LEN = 16
MODULES, FAST, HF = "cache, modules", "cache, fast=True", "transformers generate"
PRESETS = {"GPT_TINY": GPT_TINY, "LLAMA_TINY": LLAMA_TINY}


def hf_model(name: str, vocab_size: int):
    """The ``transformers`` model of the preset's shape with max_len 1024, random weights."""
    import transformers

    preset = PRESETS[name]
    if name == "GPT_TINY":
        cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=1024, n_embd=preset.d_model,
                                      n_layer=preset.n_layers, n_head=preset.n_heads,
                                      bos_token_id=None, eos_token_id=None)
        model_class = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=preset.d_model,
                                       intermediate_size=preset.ffn_dim, num_hidden_layers=preset.n_layers,
                                       num_attention_heads=preset.n_heads, num_key_value_heads=preset.kv_heads,
                                       max_position_embeddings=1024, rms_norm_eps=preset.norm_eps,
                                       tie_word_embeddings=preset.tie_embeddings,
                                       bos_token_id=None, eos_token_id=None)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_class(cfg).eval()
    model.generation_config.eos_token_id = None  # exactly the asked number of tokens, as ours
    return model


def build(name: str, vocab_size: int):
    """(ours, theirs): the same weights; ours checked to have the preset's shape."""
    theirs = hf_model(name, vocab_size)
    ours = from_hf_model(theirs)
    expected = dataclasses.replace(PRESETS[name], vocab_size=vocab_size, max_len=1024)
    for field in ("d_model", "n_layers", "n_heads", "kv_heads", "ffn_dim", "ffn", "norm", "positions",
                  "tie_embeddings", "vocab_size", "max_len"):
        got, want = getattr(ours.cfg, field), getattr(expected, field)
        assert got == want, f"the converted model has {field}={got!r}, the preset {want!r}"
    return ours, theirs


def compare(ours, theirs, prompt, n: int, rounds: int) -> dict[str, float]:
    """Best time in seconds of ``rounds`` alternating rounds of each way to generate."""
    mask = torch.ones_like(prompt)

    def hf_generate():
        with torch.inference_mode():
            return theirs.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0)

    runs = {
        MODULES: lambda: generate(ours, prompt, n, sampler=GREEDY, use_cache=True),
        FAST: lambda: generate(ours, prompt, n, sampler=GREEDY, use_cache=True, fast=True),
        "recomputing": lambda: generate(ours, prompt, n, sampler=GREEDY, use_cache=False),
        HF: hf_generate,
    }
    times = {name: [] for name in runs}
    outputs = {}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order every round
            start = time.perf_counter()
            outputs[name] = runs[name]()
            times[name].append(time.perf_counter() - start)
        reference = outputs[HF]
        for name, out in outputs.items():
            assert torch.equal(out, reference), f"{name} and transformers' generate chose different tokens"
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    text = builtin_corpus()
    tok = CharTokenizer.from_text(text)
    print(f"{args.new_tokens} new tokens after a {PROMPT_LEN}-token prompt, greedy, best of {args.rounds} "
          f"rounds; {torch.get_num_threads()} threads, torch {torch.__version__}")
    for batch in args.batch:
        starts = range(0, batch * 1000, 1000)  # a different 16-character prompt per sequence
        prompt = torch.tensor([tok.encode(text[s:s + PROMPT_LEN]) for s in starts])  # (B, 16)
        print(f"batch {batch}")
        for name in PRESETS:
            ours, theirs = build(name, tok.vocab_size)
            cfg = ours.cfg
            best = compare(ours, theirs, prompt, args.new_tokens, args.rounds)
            print(f"  {name:<10} (d={cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
                  f"{cfg.kv_heads} kv heads)")
            for way, t in best.items():
                print(f"    {way:<22}: {t:6.2f} s  ({t / args.new_tokens * 1e3:5.2f} ms/step)")
            for way in (MODULES, FAST):
                cached = best[way]
                print(f"    {way}:")
                if name == "GPT_TINY" and batch == 1:
                    print(f"      per token                    : {cached / args.new_tokens * 1e3:6.2f} ms   "
                          "target <= 0.5")
                print(f"      speed-up over recomputing    : {best['recomputing'] / cached:6.1f}x   target >= 10")
                print(f"      speed-up over transformers   : {best[HF] / cached:6.2f}x   "
                      "target >= 2 (identical tokens)")
            print(f"    fast=True / modules            : {best[MODULES] / best[FAST]:6.2f}x   "
                  "(what the module calls cost)")
    print(load())


if __name__ == "__main__":
    main()
