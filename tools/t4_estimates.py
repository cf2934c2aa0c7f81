"""How long the training cells of each notebook take on a Colab T4 with their GPU setting,
estimated from FLOPs: no GPU is needed, and none was used to make these numbers.

    python tools/t4_estimates.py                  # the table, for notebooks/ of this checkout
    python tools/t4_estimates.py path/to/notebooks  # another folder (read only)

Every notebook that trains picks its sizes with ``pick_setting(cpu=dict(...), gpu=dict(...))``.
This reads the GPU dicts from the notebook's JSON (nothing is executed) and turns them into the
training runs of that notebook (:data:`PLANS`: one function per notebook, which mirrors its training
cells and must be updated with them). A run costs its training FLOPs per token
(:func:`tutorial_lib.params.flops_per_token`: 6 N per token plus the attention term) times the
tokens it trains on. Runs whose size does not follow the GPU setting (the small fixed models of
notebooks 02, 04 and 05) are left out: they are the CPU's runs, seconds long there.

The rate: 30 % of the T4's peak. NVIDIA's T4 datasheet (Tesla T4 Tensor Core GPU, 2019) gives
65 TFLOPS for mixed precision (FP16/FP32) and 8.1 TFLOPS for single precision (FP32); the T4
(Turing, compute capability 7.5) has no TF32 and no bf16 in hardware, so an fp32 run is counted at
the FP32 rate, and a bf16 run (emulated there) at the FP32 rate as well, which is optimistic.
Small models do not reach 30 % of the peak: their steps are bound by kernel launches and Python,
so for them the estimate is a lower bound. The test ``tests/test_t4_budget.py`` asserts that no
notebook's training cells exceed :data:`BUDGET_SECONDS` by this estimate.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tutorial_lib.config import GPT_TINY, LLAMA_TINY, PRESETS, ModelConfig  # noqa: E402
from tutorial_lib.params import flops_per_token  # noqa: E402
from tutorial_lib.project import notebook_number  # noqa: E402

# NVIDIA Tesla T4 datasheet: peak FLOPs per second by precision.
T4_PEAK = {"fp16": 65e12, "fp32": 8.1e12, "bf16": 8.1e12}  # bf16: emulated, at best the FP32 rate
UTILISATION = 0.30
BUDGET_SECONDS = 180.0


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run: ``steps`` optimiser steps costing ``flops_per_step`` each, in ``precision``."""
    label: str
    steps: int
    flops_per_step: float
    precision: str = "fp16"  # what default_precision(device) gives on a T4

    @property
    def flops(self) -> float:
        return self.steps * self.flops_per_step

    @property
    def seconds(self) -> float:
        return self.flops / (UTILISATION * T4_PEAK[self.precision])


# ---- reading the settings ------------------------------------------------------------------------


class SettingError(ValueError):
    """A notebook's pick_setting call that cannot be read as literal dicts."""


def _code_cells(path: Path):
    for cell in json.loads(Path(path).read_text())["cells"]:
        if cell.get("cell_type") == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            # IPython magics and shell lines are not Python: blank them, keep the line numbers
            yield re.sub(r"^\s*[%!].*$", "", source, flags=re.M)


def _literal(node: ast.AST) -> dict:
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict" and not node.args:
        return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    value = ast.literal_eval(node)
    if not isinstance(value, dict):
        raise ValueError(f"expected a dict, got {type(value).__name__}")
    return value


def read_settings(path: Path) -> dict[str, tuple[dict, dict]]:
    """{variable: (cpu dict, gpu dict)} for every ``name = pick_setting(cpu=..., gpu=...)`` in the
    notebook. Cells that do not parse (a notebook mid-edit) are skipped; a call whose dicts are not
    literals, or that is not assigned to a name, is a :class:`SettingError`."""
    found: dict[str, tuple[dict, dict]] = {}
    for source in _code_cells(path):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        assigned = {id(node.value): node.targets for node in ast.walk(tree) if isinstance(node, ast.Assign)}
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            if not (isinstance(node, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == "pick_setting"):
                continue
            targets = assigned.get(id(node))
            if not targets or len(targets) != 1 or not isinstance(targets[0], ast.Name):
                raise SettingError(f"{Path(path).name}: a pick_setting call must be assigned to one name "
                                   f"(line {node.lineno} of its cell)")
            name, kwargs = targets[0].id, {kw.arg: kw.value for kw in node.keywords}
            try:
                cpu, gpu = _literal(kwargs["cpu"]), _literal(kwargs["gpu"])
            except (KeyError, ValueError, SyntaxError) as err:
                raise SettingError(f"{Path(path).name}: {name} = pick_setting(...) needs literal cpu= and gpu= "
                                   f"dicts ({type(err).__name__}: {err})") from None
            if name in found and found[name] != (cpu, gpu):
                raise SettingError(f"{Path(path).name}: two different settings are both named {name!r}")
            found[name] = (cpu, gpu)
    return found


# ---- FLOPs of one step ---------------------------------------------------------------------------


@cache
def char_vocab() -> int:
    """The character vocabulary of the built-in corpus, which the character-level notebooks train on."""
    from tutorial_lib.data import CharTokenizer, builtin_corpus
    return CharTokenizer.from_text(builtin_corpus()).vocab_size


def lm_step(cfg: ModelConfig, batch: int, block: int) -> float:
    """A decoder-only (or encoder) step over batch x block tokens; every query scores all block keys."""
    return batch * block * flops_per_token(cfg, context=block)["training"]


def mlm_step(cfg: ModelConfig, batch: int, block: int) -> float:
    """An encoder step plus its MLM head (a d x d transform and the d x V output matrix), which
    flops_per_token leaves out for encoders."""
    head = 6 * (cfg.d_model * cfg.d_model + cfg.d_model * cfg.vocab_size)
    return lm_step(cfg, batch, block) + batch * block * head


def seq2seq_step(cfg: ModelConfig, batch: int, source_len: int, target_len: int) -> float:
    """An encoder-decoder step: the encoder over the source, the decoder (self-attention, FFN, head)
    over the target, and cross-attention: queries and outputs per target token, keys and values per
    source token, scores of every target token against every source token. Training is 3x forward."""
    encoder = dataclasses.replace(cfg, family="encoder", src_vocab_size=None, n_decoder_layers=None,
                                  share_embeddings=False)
    decoder = dataclasses.replace(encoder, family="decoder", n_layers=cfg.decoder_layers)
    d, h, h_kv, d_k = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    cross_forward = cfg.decoder_layers * (target_len * 2 * 2 * d * h * d_k + source_len * 2 * 2 * d * h_kv * d_k
                                          + target_len * 2 * source_len * h * 2 * d_k)  # scores, weighted values
    per_example = (source_len * flops_per_token(encoder, context=source_len)["training"]
                   + target_len * flops_per_token(decoder, context=target_len)["training"] + 3 * cross_forward)
    return batch * per_example


# ---- the training runs of each notebook ----------------------------------------------------------


def plan_00(s) -> list[Run]:
    g = s["setting"]
    cfg = dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=char_vocab(), d_model=g["d_model"],
                              n_layers=g["n_layers"], max_len=g["block"])
    return [Run("a first model", g["steps"], lm_step(cfg, g["batch"], g["block"]))]


def plan_03(s) -> list[Run]:
    g = s["setting"]
    # the extrapolation experiment: five position schemes plus the unscaled sinusoidal model, each a
    # 2-layer d=64 decoder on batches of 32 periodic sequences of length L = 32; train's default fp32
    cfg = ModelConfig(family="decoder", vocab_size=16, d_model=64, n_layers=2, n_heads=4, max_len=64)
    return [Run("position schemes (6 runs)", 6 * g["steps"], lm_step(cfg, 32, 32), "fp32")]


def plan_04(s) -> list[Run]:
    probe, mlm = s["probe_setting"], s["mlm_setting"]
    del probe  # gradient norms at initialisation: one backward pass per trial, no optimiser step
    # the warm-up sweep that 04 ran before issue 26 moved out of it (to 08b_stability_studies)
    cfg = ModelConfig(family="encoder", vocab_size=char_vocab() + 3, d_model=mlm["d_model"], n_heads=4,
                      n_layers=mlm["n_layers"], max_len=64, ffn="gelu", positions="rope")
    return [Run("masked language model", mlm["steps"], mlm_step(cfg, mlm["batch"], 64))]


def _dates():
    from tutorial_lib import dates
    return dates


def plan_05(s) -> list[Run]:
    g, dates = s["setting"], _dates()
    cfg = dates.model_config(d_model=g["d_model"], d_ff=g.get("d_ff", 4 * g["d_model"]), n_layers=g["n_layers"])
    # sources padded to the longest in the batch: at most MAX_SOURCE_LEN (+1 for EOS), an upper bound
    return [Run("date translation", g["steps"],
                seq2seq_step(cfg, g["batch"], dates.MAX_SOURCE_LEN + 1, dates.TARGET_LEN))]


def plan_06(s) -> list[Run]:
    S, A = s["S"], s["A"]
    gpt = dataclasses.replace(GPT_TINY, vocab_size=char_vocab(), d_model=S["d_model"], n_layers=S["n_layers"],
                              n_heads=S["n_heads"], max_len=S["block"])
    block_a = A.get("block", S["block"])  # .get: versions without the key used S's block and batch
    # the ablation: GPT, five one-change variants ending at the LLaMA design, and two more GPT seeds;
    # each run is counted at the costlier of the two ends
    ends = [dataclasses.replace(base, vocab_size=char_vocab(), d_model=A["d_model"], n_layers=A["n_layers"],
                                n_heads=A["n_heads"], max_len=block_a) for base in (GPT_TINY, LLAMA_TINY)]
    ablation = max(lm_step(cfg, A.get("batch", S["batch"]), block_a) for cfg in ends)
    return [Run("character GPT", S["steps"], lm_step(gpt, S["batch"], S["block"])),
            Run("GPT -> LLaMA ablation (8 runs)", 8 * A["steps"], ablation)]


def plan_06a(s) -> list[Run]:
    D, dates = s["D"], _dates()
    encdec = dates.model_config(d_model=D["d_model"], d_ff=D.get("d_ff", 4 * D["d_model"]),
                                n_layers=D.get("n_layers", 2))
    prompt = dates.MAX_SOURCE_LEN + 1 + dates.TARGET_LEN  # source, separator, answer and EOS
    decoder = dataclasses.replace(encdec, family="decoder", vocab_size=dates.SOURCE.vocab_size, src_vocab_size=None,
                                  n_layers=2 * encdec.n_layers, n_decoder_layers=None, share_embeddings=False,
                                  positions="rope", max_len=prompt)
    # the encoder-only model: the same blocks over source, separator and ten slots, plus BERT's MLM head
    encoder = dataclasses.replace(decoder, family="encoder", vocab_size=dates.SOURCE.vocab_size + 1)
    return [Run("encoder-decoder on dates", D["steps"],
                seq2seq_step(encdec, D["batch"], dates.MAX_SOURCE_LEN + 1, dates.TARGET_LEN)),
            Run("decoder-only and prefix-LM on dates", 2 * D["steps"], lm_step(decoder, D["batch"], prompt)),
            Run("encoder-only on dates", D["steps"], mlm_step(encoder, D["batch"], prompt - 1))]


def plan_07a(s) -> list[Run]:
    A = s["A"]
    dense = dataclasses.replace(LLAMA_TINY, vocab_size=char_vocab(), d_model=A["d_model"], n_layers=A["n_layers"],
                                n_heads=A["n_heads"], n_kv_heads=A["n_heads"] // 2,
                                d_ff=8 * (8 * A["d_model"] // 3 // 8), max_len=A["block"])
    moe = dataclasses.replace(dense, n_experts=4, experts_per_token=2, expert_d_ff=dense.d_ff // 2)
    same_total = dataclasses.replace(dense, d_ff=4 * moe.expert_d_ff)
    # two MoE runs, the dense model of the same total, the dense model of the same active at three seeds;
    # each counted at the costlier of the dense-same-total and MoE steps
    step = max(lm_step(cfg, A["batch"], A["block"]) for cfg in (moe, same_total))
    return [Run("MoE and dense comparison (6 runs)", 6 * A["steps"], step)]


def plan_08(s) -> list[Run]:
    g = s["setting"]
    base = ModelConfig(family="decoder", vocab_size=char_vocab(), d_model=g["d_model"], n_layers=g["n_layers"],
                       n_heads=4, max_len=g["block"])
    step = lm_step(base, g["batch"], g["block"])
    return [Run("baseline", g["steps"], step),
            Run("two broken runs (labels, mask)", 2 * g["steps"], step, "fp32"),
            Run("spike: trunk and three one-step forks", 30 + 3, step, "fp32"),
            Run("an overflow at step 5 (the checklist)", 10, step, "fp32")]


def plan_08a(s) -> list[Run]:
    g = s["setting"]
    base = ModelConfig(family="decoder", vocab_size=char_vocab(), d_model=g["d_model"], n_layers=g["n_layers"],
                       n_heads=4, max_len=g["block"])
    step = lm_step(base, g["batch"], g["block"])
    # the checkpoint section (a fixed d=64 model) and the DDP runs (d=32) keep their CPU size: not counted
    return [Run("precision: fp32", g["steps"], step, "fp32"),
            Run("precision: bf16 (emulated on a T4)", g["steps"], step, "bf16"),
            Run("precision: fp16 with the gradient scaler", g["steps"], step, "fp16"),
            Run("accumulation: six gradients by hand, then 3 + 3 steps", 6 + 3 + 3, step, "fp32")]


def plan_08b(s) -> list[Run]:
    sweep = s["sweep_setting"]
    # the warmup sweep: 2 norm orders x (no warmup, warmup) x each learning rate, on a fixed 6-layer
    # d=64 model with an untied head and batches of 16 x 32; train's default fp32. The rest of the
    # notebook is forward and backward passes at initialisation, no optimiser step
    cfg = ModelConfig(family="decoder", vocab_size=char_vocab(), d_model=64, n_layers=6, n_heads=4, max_len=32,
                      scale_embeddings=True, tie_embeddings=False)
    runs = 2 * 2 * len(sweep["lrs"])
    return [Run(f"warm-up sweep ({runs} runs)", runs * sweep["steps"], lm_step(cfg, 16, 32), "fp32")]


def plan_09(s) -> list[Run]:
    g = s["S"]
    char = dataclasses.replace(GPT_TINY, vocab_size=char_vocab(), d_model=g["d_model"], n_layers=g["n_layers"],
                               n_heads=g["n_heads"], max_len=g["block"])
    seeds = g.get("seeds", 1)
    # the BPE model is given the steps that match the character model's FLOPs: twice the character runs
    return [Run(f"characters and BPE, {seeds} seed(s) each", 2 * seeds * g["char_steps"],
                lm_step(char, g["batch"], g["block"]))]


def plan_11(s) -> list[Run]:
    g = s["S"]
    small = dataclasses.replace(LLAMA_TINY, vocab_size=g["vocab"], d_model=g["d_model"], n_layers=g["n_layers"],
                                d_ff=3 * g["d_model"], max_len=g["block"])
    return [Run("the small LLaMA-style model quantized and saved", g["steps"], lm_step(small, g["batch"], g["block"]))]


def plan_12(s) -> list[Run]:
    g = s["S"]
    # SmolLM2-135M (the bundled model's GGUF metadata); a chat example is about 70 tokens. Counted as
    # full training steps (6 FLOPs per parameter and token): LoRA skips the weights' gradients, so
    # this is an upper bound
    smol = dataclasses.replace(LLAMA_TINY, vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                               d_ff=1536, max_len=8192, tie_embeddings=True)
    chat = 72
    return [Run("LoRA fine-tuning, masked (and the unmasked comparison)", g["steps"] + g["early"],
                lm_step(smol, g["batch"], chat)),
            Run("on the 4-bit base and on its float32 copy", 2 * g["q_steps"], lm_step(smol, g["batch"], chat)),
            Run("DPO: chosen and rejected, with the frozen reference's forward", g["dpo_steps"],
                lm_step(smol, 2 * g["dpo_batch"], chat) * 4 / 3)]


PLANS: dict[str, Callable[[dict[str, dict]], list[Run]]] = {
    "00": plan_00, "03": plan_03, "04": plan_04, "05": plan_05, "06": plan_06, "06a": plan_06a,
    "07a": plan_07a, "08": plan_08,
    "08a": plan_08a, "08b": plan_08b, "09": plan_09, "11": plan_11, "12": plan_12}


class _Reads(dict):
    """The GPU settings, remembering which of them a plan read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


@dataclasses.dataclass
class Estimate:
    notebook: str
    runs: list[Run]
    unread: list[str]  # settings of the notebook that its plan does not use: not in the estimate

    @property
    def flops(self) -> float:
        return sum(r.flops for r in self.runs)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.runs)


def estimate(path: Path, settings: dict[str, tuple[dict, dict]] | None = None) -> Estimate | None:
    """The training runs of one notebook with its GPU setting, or None for a notebook that picks no
    setting. ``settings`` (as :func:`read_settings` returns them) replaces what the file holds."""
    path = Path(path)
    settings = read_settings(path) if settings is None else settings
    if not settings:
        return None
    number = notebook_number(path.name)
    if number not in PLANS:
        raise SettingError(f"{path.name} picks a setting ({', '.join(settings)}) but tools/t4_estimates.py has "
                           "no plan of its training cells: add one to PLANS")
    gpu = _Reads({name: pair[1] for name, pair in settings.items()})
    try:
        runs = PLANS[number](gpu)
    except KeyError as err:
        raise SettingError(f"{path.name}: the plan in tools/t4_estimates.py reads {err.args[0]!r}, which the "
                           f"notebook's settings {sorted(settings)} lack: update the plan with the notebook") from None
    return Estimate(path.name, runs, sorted(set(settings) - gpu.read))


def table(folder: Path) -> str:
    rows = [f"{'notebook':<28} {'training FLOPs':>14} {'steps':>6} {'T4 estimate':>12}"]
    for path in sorted(Path(folder).glob("[0-9][0-9]*_*.ipynb")):
        found = estimate(path)
        if found is None:
            rows.append(f"{path.name:<28} {'-':>14} {'-':>6} {'no GPU setting':>14}")
            continue
        steps = sum(r.steps for r in found.runs)
        rows.append(f"{path.name:<28} {found.flops:>14.2e} {steps:>6} {found.seconds:>10.0f} s")
        for r in found.runs:
            rows.append(f"  {r.label:<40} {r.flops:>9.2e} {r.precision:>5} {r.seconds:>6.1f} s")
    rate = ", ".join(f"{p} {UTILISATION * T4_PEAK[p] / 1e12:.1f}" for p in ("fp16", "fp32"))
    rows.append(f"(estimates: FLOPs / ({UTILISATION:.0%} of the T4's datasheet peak) = TFLOPS {rate}; "
                f"budget {BUDGET_SECONDS:.0f} s per notebook)")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "notebooks"))
