"""Bad input, tried as a new learner would: one row per bad call, with the exception it must
raise and words its message must contain (the argument's name, what was expected, what came).
Never a raw error from inside torch, a NaN or a silent wrong answer.

A row whose exception is ``None`` is a call that must *not* raise (the exercise checker): its
result's text must contain the words instead.
"""

import contextlib
import io
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tutorial_lib import checkpoint as ck
from tutorial_lib import data as D
from tutorial_lib import masks as M
from tutorial_lib import params as P
from tutorial_lib import sampling as S
from tutorial_lib import train as TR
from tutorial_lib.attention import KVCache, MultiHeadAttention, fused_attention, scaled_dot_product_attention
from tutorial_lib.config import ModelConfig, from_hf_config, preset
from tutorial_lib.encoder_only import MaskedLM, SequenceClassifier, mask_tokens
from tutorial_lib.exercises import check, reference
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.layers import RMSNorm
from tutorial_lib.transformer import EncoderDecoder

V = 11


@dataclass
class Env:
    """Small models, a tokenizer, checkpoint folders and config files, built once."""

    lm: DecoderOnlyLM
    s2s: EncoderDecoder
    mlm: MaskedLM
    clf: SequenceClassifier
    tok: D.CharTokenizer
    ids: torch.Tensor  # (2, 5) ids in [0, V)
    saved: Path  # a folder with steps 1 and 2 of `lm`
    damaged: Path  # ... whose step-2 weights are truncated
    bad_pointer: Path  # ... whose latest.json is not JSON
    empty: Path
    files: Path  # config.json files for the parameter CLI


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    torch.manual_seed(0)
    small = dict(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=8)
    lm = DecoderOnlyLM(ModelConfig(**small))
    s2s = EncoderDecoder(ModelConfig(family="encoder-decoder", **small)).eval()
    enc = ModelConfig(family="encoder", **small)
    root = tmp_path_factory.mktemp("bad_inputs")
    folders = {}
    for name in ("saved", "damaged", "bad_pointer"):
        folders[name] = root / name
        ck.save_checkpoint(folders[name], lm, step=1)
        ck.save_checkpoint(folders[name], lm, step=2)
    weights = folders["damaged"] / "model-00000002.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (folders["bad_pointer"] / "latest.json").write_text('{"format": 2, "step": ')
    files = root / "files"
    files.mkdir()
    (files / "bad.json").write_text("{not json")
    (files / "gemma2.json").write_text(json.dumps({"model_type": "gemma2"}))
    (files / "latin1.json").write_bytes(b"\xff\xfe{}")
    (root / "empty").mkdir()
    return Env(lm, s2s, MaskedLM(enc), SequenceClassifier(enc, 3), D.CharTokenizer.from_text("abc", ("<pad>",)),
               torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0)), folders["saved"],
               folders["damaged"], folders["bad_pointer"], root / "empty", files)


def qkv(B=2, h=2, T=3, S=4, d=8):
    return torch.randn(B, h, T, d), torch.randn(B, h, S, d), torch.randn(B, h, S, d)


def cli(*argv):
    """Run ``python -m tutorial_lib.params`` in-process; an argparse error becomes a SystemExit
    whose text is what the command line printed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            P.main(list(map(str, argv)))
    except SystemExit as exit_:
        raise SystemExit(f"exit code {exit_.code}: {err.getvalue()}") from None


def greedy(e, **special):
    return S.greedy_decode(e.s2s, e.ids, **({"max_len": 4, "bos_id": 1, "eos_id": 2, "pad_id": 0} | special))


def attention_answer(transform):
    """A learner's attention whose output is the right answer passed through ``transform``."""
    def attention(q, k, v, mask=None):
        return transform(reference("01.attention")(q, k, v, mask))
    return attention


def with_nan(out):
    out = out.clone()
    out[0, 1, 2] = float("nan")
    return out


def bad_loss_train(e, compute_loss):
    opt = TR.make_optimizer(e.lm, 1e-3)
    return TR.train(e.lm, lambda i: (e.ids, e.ids), 1, optimizer=opt, compute_loss=compute_loss, progress=False)


VE = ValueError
ROWS = [
    # ---- masks --------------------------------------------------------------------------------
    ("causal_mask T float", lambda e: M.causal_mask(3.0), VE, ["T", "positive int", "3.0"]),
    ("causal_mask S < T", lambda e: M.causal_mask(5, 3), VE, ["S >= T", "T=5", "S=3"]),
    ("padding_mask lengths > S", lambda e: M.padding_mask(torch.tensor([4, 7]), 5), VE, ["lengths", "[0, S=5]", "7"]),
    ("padding_mask float lengths", lambda e: M.padding_mask(torch.tensor([2.0, 3.0]), 4), VE,
     ["integer lengths", "torch.float32"]),
    ("cross_mask float flags", lambda e: M.cross_mask(torch.ones(2, 3), torch.ones(2, 4)), VE,
     ["target_keep", "boolean keep flags", "float32"]),
    ("prefix_lm_mask float", lambda e: M.prefix_lm_mask(2.0, 4), VE, ["prefix_len", "[0, T=4]", "2.0"]),
    ("sliding_window_mask 0", lambda e: M.sliding_window_mask(4, 0), VE, ["window", "positive int", "0"]),
    ("combine a list", lambda e: M.combine(M.causal_mask(3), [[True]]), VE, ["combine", "boolean", "list"]),
    ("combine float mask", lambda e: M.combine(torch.ones(3, 3)), VE, ["boolean", "torch.float32"]),
    ("to_blocked a list", lambda e: M.to_blocked([[True]]), VE, ["mask", "boolean tensor", "list"]),
    ("key_padding_to_torch 2-D", lambda e: M.key_padding_to_torch(torch.ones(2, 3, dtype=torch.bool)), VE,
     ["(B, 1, 1, S)", "(2, 3)"]),
    ("from_additive a bias", lambda e: M.from_additive(torch.tensor([0.0, -2.5, -1e9])), VE,
     ["<= -1000", "-2.5", "bias, not a mask"]),
    ("from_additive ints", lambda e: M.from_additive(torch.tensor([0, 1])), VE, ["floating-point", "int64"]),
    # ---- attention ----------------------------------------------------------------------------
    ("attention q 3-D", lambda e: scaled_dot_product_attention(torch.randn(2, 3, 8), *qkv()[1:]), VE,
     ["q", "4 dimensions", "(2, 3, 8)"]),
    ("attention (B, T, S) mask", lambda e: fused_attention(*qkv(), torch.ones(2, 3, 4, dtype=torch.bool)), VE,
     ["3-D mask", "(2, 3, 4)", "mask[:, None]"]),
    ("attention (h, T, S) bias", lambda e: scaled_dot_product_attention(*qkv(), bias=torch.zeros(2, 3, 4)), VE,
     ["3-D bias", "bias[None]"]),
    ("attention (B, S) padding mask", lambda e: fused_attention(*qkv(), torch.ones(2, 4, dtype=torch.bool)), VE,
     ["(2, 4)", "(B, h, T, S) = (2, 2, 3, 4)", "mask[:, None, None, :]"]),
    ("attention float mask", lambda e: fused_attention(*qkv(), torch.zeros(3, 4)), VE,
     ["mask must be boolean", "from_additive"]),
    ("attention 1-D mask", lambda e: fused_attention(*qkv(), torch.ones(4, dtype=torch.bool)), VE,
     ["2-D (T, S) or 4-D", "1-D"]),
    ("attention int q", lambda e: fused_attention(*(t.long() for t in qkv())), VE, ["q", "floating-point", "int64"]),
    ("attention mixed dtypes", lambda e: fused_attention(qkv()[0].double(), *qkv()[1:]), VE,
     ["one dtype", "float64", "float32"]),
    ("attention dropout_p 1.5", lambda e: scaled_dot_product_attention(*qkv(), dropout_p=1.5), VE,
     ["dropout_p", "[0, 1)", "1.5"]),
    ("MultiHeadAttention n_heads float", lambda e: MultiHeadAttention(64, 4.0), VE, ["n_heads", "int", "4.0"]),
    ("MultiHeadAttention head_dim=64/4", lambda e: MultiHeadAttention(64, 4, head_dim=64 / 4), VE,
     ["head_dim", "16.0", "int(16.0)"]),
    ("MultiHeadAttention wrong width", lambda e: MultiHeadAttention(16, 2)(torch.randn(2, 5, 8)), VE,
     ["x", "(B, T, d_model=16)", "(2, 5, 8)"]),
    ("MultiHeadAttention GQA heads", lambda e: MultiHeadAttention(48, 6, n_kv_heads=4), VE,
     ["n_heads (6)", "n_kv_heads (4)"]),
    ("KVCache n_layers float", lambda e: KVCache(2.0), VE, ["n_layers", "2.0"]),
    ("RMSNorm wrong width", lambda e: RMSNorm(8)(torch.randn(2, 4)), VE, ["RMSNorm(8)", "width 8", "(2, 4)"]),
    ("TransformerBlock wrong width", lambda e: e.lm.blocks[0](torch.randn(2, 3, 8)), VE,
     ["x", "(B, T, d_model=16)", "(2, 3, 8)"]),
    ("DecoderLayer memory of another width", lambda e: e.s2s.decoder.layers[0](torch.randn(2, 3, 16),
                                                                               torch.randn(2, 4, 8)), VE,
     ["memory", "d_model=16", "(2, 4, 8)"]),
    # ---- configs --------------------------------------------------------------------------------
    ("ModelConfig head_dim float", lambda e: ModelConfig(head_dim=64 / 4), VE, ["head_dim", "16.0"]),
    ("ModelConfig d_model % n_heads", lambda e: ModelConfig(d_model=30, n_heads=4), VE,
     ["d_model (30)", "n_heads (4)"]),
    ("ModelConfig dropout string", lambda e: ModelConfig(dropout="0.1"), VE, ["dropout", "number", "'0.1'"]),
    ("ModelConfig bias string", lambda e: ModelConfig(bias="no"), VE, ["bias", "True or False", "'no'"]),
    ("ModelConfig rope_base 0", lambda e: ModelConfig(positions="rope", rope_base=0.0), VE, ["rope_base", "> 1"]),
    ("ModelConfig family", lambda e: ModelConfig(family="gpt"), VE, ["family", "'gpt'", "decoder"]),
    ("preset unknown field", lambda e: preset("gpt-tiny", widht=3), VE, ["unknown ModelConfig fields", "widht"]),
    ("preset unknown name", lambda e: preset("gpt-5"), VE, ["no preset named 'gpt-5'", "gpt-tiny"]),
    ("from_hf_config a list", lambda e: from_hf_config([1]), VE, ["config.json dict", "list"]),
    # ---- models ---------------------------------------------------------------------------------
    ("LM float ids", lambda e: e.lm(e.ids.float()), VE, ["ids", "integer token ids", "float32"]),
    ("LM ids as a list", lambda e: e.lm([[1, 2]]), VE, ["ids", "tensor", "list", "torch.tensor"]),
    ("LM ids out of range", lambda e: e.lm(torch.tensor([[1, 11, 3, 40]])), VE,
     ["ids", "[0, 10]", "[11, 40]", "ids[0, 1]"]),
    ("LM context too long", lambda e: e.lm(torch.zeros(1, 9, dtype=torch.long)), VE,
     ["ids", "9 positions", "max_len=8", "ids[:, -8:]"]),
    ("LM cache overflow", lambda e: e.lm(e.ids[:, :1], cache=_filled_cache(e)), VE,
     ["ids", "after 8 cached", "max_len=8", "new cache"]),
    ("LM targets out of range", lambda e: e.lm(e.ids, torch.tensor([[0, 1, 2, 3, 12]] * 2)), VE,
     ["targets", "[0, 10]", "ignore_index=-100", "[12]"]),
    ("LM negative targets", lambda e: e.lm(e.ids, torch.tensor([[-1, 1, 2, 3, -100]] * 2)), VE,
     ["targets", "ignore_index=-100", "[-1]"]),
    ("LM targets float", lambda e: e.lm(e.ids, e.ids.float()), VE, ["targets", "integer", "float32"]),
    ("LM every target ignored", lambda e: e.lm(e.ids, torch.full((2, 5), -100)), VE,
     ["targets", "ignore_index=-100", "0 / 0"]),
    ("LM ignore_index float", lambda e: e.lm(e.ids, e.ids, ignore_index=-100.0), VE, ["ignore_index", "-100.0"]),
    ("LM (B, T, S) mask", lambda e: e.lm(e.ids, mask=torch.ones(2, 5, 5, dtype=torch.bool)), VE,
     ["3-D mask", "mask[:, None]"]),
    ("seq2seq src out of range", lambda e: e.s2s(e.ids + 20, e.ids), VE, ["src", "[0, 10]", "first at src[0, 0]"]),
    ("seq2seq tgt_in out of range", lambda e: e.s2s(e.ids, e.ids + 20), VE, ["tgt_in", "[0, 10]"]),
    ("seq2seq targets out of range", lambda e: e.s2s(e.ids, e.ids, e.ids + 20), VE,
     ["targets", "ignore_index=-100", "[0, 10]"]),
    ("seq2seq targets, ignore_index=0", lambda e: e.s2s(e.ids, e.ids, torch.full((2, 5), -100), ignore_index=0), VE,
     ["targets", "ignore_index=0", "[-100]"]),
    ("seq2seq tgt_in too long", lambda e: e.s2s(e.ids, torch.zeros(2, 9, dtype=torch.long)), VE,
     ["tgt_in", "9 positions", "max_len=8"]),
    ("seq2seq (B, S) src_mask", lambda e: e.s2s(e.ids, e.ids, src_mask=torch.ones(2, 5, dtype=torch.bool)), VE,
     ["src_mask", "(2, 5)", "[:, None, None, :]"]),
    ("seq2seq batch mismatch", lambda e: e.s2s(e.ids, e.ids[:1]), VE, ["src and tgt_in", "2 and 1"]),
    ("seq2seq label_smoothing", lambda e: e.s2s(e.ids, e.ids, e.ids, label_smoothing=1.5), VE,
     ["label_smoothing", "[0, 1)", "1.5"]),
    ("MLM labels out of range", lambda e: e.mlm(e.ids, torch.tensor([[-100, 30, -100, -100, -100]] * 2)), VE,
     ["labels", "[0, 10]", "ignore_index=-100", "[30]"]),
    ("classifier labels out of range", lambda e: e.clf(e.ids, torch.tensor([0, 3])), VE,
     ["labels", "[0, 2]", "ignore_index=-100", "[3]"]),
    ("classifier labels float", lambda e: e.clf(e.ids, torch.tensor([0.0, 1.0])), VE, ["labels", "integer", "float32"]),
    ("classifier lengths too long", lambda e: e.clf(e.ids, lengths=torch.tensor([5, 6])), VE,
     ["lengths", "[1, T=5]", "6"]),
    ("mask_tokens mask_id float", lambda e: mask_tokens(e.ids, mask_id=1.5, vocab_size=V), VE, ["mask_id", "1.5"]),
    # ---- decoding ---------------------------------------------------------------------------------
    ("generate on an encoder-decoder", lambda e: S.generate(e.s2s, e.ids, 3), VE,
     ["decoder-only", "greedy_decode", "beam_search"]),
    ("generate max_new_tokens float", lambda e: S.generate(e.lm, e.ids, 3.0), VE, ["max_new_tokens", "3.0"]),
    ("generate a temperature as sampler", lambda e: S.generate(e.lm, e.ids, 3, sampler=0.7), VE,
     ["sampler", "Sampler(", "0.7"]),
    ("generate empty prompt", lambda e: S.generate(e.lm, e.ids[:, :0], 3), VE, ["ids", "(2, 0)", "no token ids"]),
    ("generate ids out of range", lambda e: S.generate(e.lm, e.ids + 20, 3), VE, ["ids", "[0, 10]"]),
    ("greedy_decode eos_id outside", lambda e: greedy(e, eos_id=50), VE, ["eos_id=50", "[0, 10]", "vocab_size=11"]),
    ("greedy_decode bos_id outside", lambda e: greedy(e, bos_id=11), VE, ["bos_id=11", "vocab_size=11"]),
    ("greedy_decode pad_id negative", lambda e: greedy(e, pad_id=-1), VE, ["pad_id", "int >= 0", "-1"]),
    ("greedy_decode a decoder-only model", lambda e: S.greedy_decode(e.lm, e.ids, max_len=4, bos_id=1, eos_id=2,
                                                                     pad_id=0), VE, ["encoder-decoder", "generate"]),
    ("greedy_decode max_len past the model", lambda e: greedy(e, max_len=9), VE, ["max_len=9", "max_len=8"]),
    ("beam_search pad_id outside", lambda e: S.beam_search(e.s2s, e.ids, max_len=4, bos_id=1, eos_id=2,
                                                           pad_id=50), VE, ["pad_id=50", "vocab_size=11"]),
    ("beam_search n_best > beam_width", lambda e: S.beam_search(e.s2s, e.ids, max_len=4, bos_id=1, eos_id=2,
                                                                pad_id=0, beam_width=2, n_best=3), VE,
     ["n_best (3)", "beam_width (2)"]),
    ("sequence_log_prob tgt_out outside", lambda e: S.sequence_log_prob(e.s2s, e.ids, e.ids + 20, bos_id=1,
                                                                       pad_id=0), VE, ["tgt_out", "[0, 10]"]),
    # ---- sampling ---------------------------------------------------------------------------------
    ("Sampler temperature 0", lambda e: S.Sampler(temperature=0), VE, ["temperature", "> 0", "greedy=True"]),
    ("Sampler top_k float", lambda e: S.Sampler(top_k=2.0), VE, ["top_k", "int", "2.0"]),
    ("Sampler top_p 1.5", lambda e: S.Sampler(top_p=1.5), VE, ["top_p", "(0, 1]", "1.5"]),
    ("Sampler NaN logits", lambda e: S.Sampler()(torch.full((1, 4), float("nan"))), VE, ["logits", "NaN", "4 of 4"]),
    ("top_k_filter k=0", lambda e: S.top_k_filter(torch.randn(2, 5), 0), VE, ["k >= 1", "0"]),
    # ---- tokenizer --------------------------------------------------------------------------------
    ("CharTokenizer from empty text", lambda e: D.CharTokenizer.from_text(""), VE, ["text is empty"]),
    ("CharTokenizer specials as a string", lambda e: D.CharTokenizer.from_text("ab", "<pad>"), VE,
     ["specials", "('<pad>',)"]),
    ("encode a number", lambda e: e.tok.encode(123), VE, ["encode", "string", "int"]),
    ("encode an unknown character", lambda e: e.tok.encode("abz"), VE, ["'z'", "text[2]", "3 characters"]),
    ("decode an int", lambda e: e.tok.decode(5), VE, ["decode", "sequence", "5"]),
    ("decode an id outside", lambda e: e.tok.decode([1, 9]), VE, ["id 9", "vocabulary of 4"]),
    ("special_id unknown", lambda e: e.tok.special_id("<unk>"), VE, ["'<unk>'", "'<pad>'"]),
    # ---- data ---------------------------------------------------------------------------------------
    ("train_val_split a list", lambda e: D.train_val_split([1, 2, 3]), VE, ["ids", "1-D token stream", "list"]),
    ("train_val_split fraction 1", lambda e: D.train_val_split(torch.arange(10), 1.0), VE,
     ["val_fraction", "(0, 1)", "1.0"]),
    ("lm_batch batch_size float", lambda e: D.lm_batch(torch.arange(100), 2.0, 4), VE, ["batch_size", "2.0"]),
    ("lm_batch stream too short", lambda e: D.lm_batch(torch.arange(10), 2, 10), VE,
     ["stream (10 tokens)", "block_size (10)"]),
    ("lm_windows max_windows 0", lambda e: D.lm_windows(torch.arange(100), 4, max_windows=0), VE,
     ["max_windows", ">= 1", "0"]),
    ("pad_sequences a string", lambda e: D.pad_sequences("abc", 0), VE, ["list of id lists", "str"]),
    ("pad_sequences pad_id float", lambda e: D.pad_sequences([[1, 2], [3]], 0.5), VE, ["pad_id", "0.5"]),
    ("pad_sequences a row of floats", lambda e: D.pad_sequences([[1, 2], [3.0]], 0), VE, ["seqs[1]", "int ids"]),
    ("load_corpus missing file", lambda e: D.load_corpus(e.empty / "none.txt"), VE, ["no text file", "none.txt"]),
    # ---- training -----------------------------------------------------------------------------------
    ("make_optimizer lr 0", lambda e: TR.make_optimizer(e.lm, 0.0), VE, ["lr must be positive", "0.0"]),
    ("make_optimizer lr string", lambda e: TR.make_optimizer(e.lm, "1e-3"), VE, ["lr must be positive", "'1e-3'"]),
    ("warmup_cosine_schedule float", lambda e: TR.warmup_cosine_schedule(10.0, 100), VE,
     ["warmup_steps", "10.0", "int(10.0)"]),
    ("inverse_sqrt_schedule 0", lambda e: TR.inverse_sqrt_schedule(0), VE, ["warmup_steps", ">= 1", "0"]),
    ("label_smoothed_loss target outside", lambda e: TR.label_smoothed_loss(torch.randn(2, 3), torch.tensor([0, 5])),
     VE, ["targets", "[0, 2]", "ignore_index=-100", "[5]"]),
    ("label_smoothed_loss smoothing 1", lambda e: TR.label_smoothed_loss(torch.randn(2, 3), torch.tensor([0, 1]), 1.0),
     VE, ["smoothing", "[0, 1)", "1.0"]),
    ("train steps float", lambda e: TR.train(e.lm, lambda i: (e.ids, e.ids), 2.0,
                                             optimizer=TR.make_optimizer(e.lm, 1e-3), progress=False), VE,
     ["steps", "2.0"]),
    ("train without an optimizer", lambda e: TR.train(e.lm, lambda i: (e.ids, e.ids), 2, optimizer=None,
                                                      progress=False), VE, ["optimizer", "make_optimizer", "NoneType"]),
    ("train on a batch without targets", lambda e: bad_loss_train(e, lambda m, b: m(b[0]).loss), VE,
     ["compute_loss returned None", "(inputs, targets)"]),
    ("train on a loss per position", lambda e: bad_loss_train(e, lambda m, b: m(*b).logits.mean(-1)), VE,
     ["scalar", "(2, 5)", ".mean()"]),
    ("train on a loss without gradient", lambda e: bad_loss_train(e, lambda m, b: m(*b).loss.detach()), VE,
     ["no gradient", "backward"]),
    ("train fp16 on the CPU", lambda e: TR.train(e.lm, lambda i: (e.ids, e.ids), 1, precision="fp16",
                                                 optimizer=TR.make_optimizer(e.lm, 1e-3), progress=False), VE,
     ["fp16", "CUDA", "bf16"]),
    # ---- checkpoints --------------------------------------------------------------------------------
    ("load from an empty folder", lambda e: ck.load_checkpoint(e.empty, e.lm), VE,
     ["no checkpoint here", "latest.json"]),
    ("load a truncated weights file", lambda e: ck.load_checkpoint(e.damaged, e.lm), VE,
     ["model-00000002.safetensors is damaged", "step=N", "[1]"]),
    ("load with a damaged pointer", lambda e: ck.load_checkpoint(e.bad_pointer, e.lm), VE,
     ["latest.json", "damaged", "[1, 2]", "step=N"]),
    ("load into another shape", lambda e: ck.load_checkpoint(e.saved, DecoderOnlyLM(replace(e.lm.cfg, d_model=32))),
     VE, ["embed.tokens.weight", "(11, 16)", "(11, 32)", "saved_config", "d_model=16"]),
    ("load a step not kept", lambda e: ck.load_checkpoint(e.saved, e.lm, step=7), VE,
     ["no complete checkpoint of step 7", "[1, 2]"]),
    ("load step as a string", lambda e: ck.load_checkpoint(e.saved, e.lm, step="2"), VE, ["step", "'2'"]),
    ("save a negative step", lambda e: ck.save_checkpoint(e.empty / "x", e.lm, step=-1), VE,
     ["step", "non-negative int", "-1"]),
    ("save keep 0", lambda e: ck.save_checkpoint(e.empty / "x", e.lm, step=1, keep=0), VE, ["keep", ">= 1", "0"]),
    # ---- the parameter CLI ----------------------------------------------------------------------------
    ("params CLI missing file", lambda e: cli("nope.json"), SystemExit,
     ["exit code 2", "'nope.json' is neither a config.json file nor a preset", "gpt2-small"]),
    ("params CLI invalid JSON", lambda e: cli(e.files / "bad.json"), SystemExit, ["bad.json is not valid JSON"]),
    ("params CLI not UTF-8", lambda e: cli(e.files / "latin1.json"), SystemExit, ["latin1.json", "UTF-8"]),
    ("params CLI unsupported model", lambda e: cli(e.files / "gemma2.json"), SystemExit,
     ["'gemma2' is not supported", "soft-capping"]),
    ("params CLI batch 0", lambda e: cli("gpt2-small", "--batch", 0), SystemExit, ["batch", "positive int", "0"]),
    ("params CLI batch float", lambda e: cli("gpt2-small", "--batch", 2.5), SystemExit, ["--batch", "'2.5'"]),
    ("params CLI seq-len past max_len", lambda e: cli("gpt2-small", "--seq-len", 5000), SystemExit,
     ["seq_len 5000", "max_len=1024"]),
    ("params CLI source-len on a decoder", lambda e: cli("gpt2-small", "--source-len", 10), SystemExit,
     ["--source-len", "encoder-decoder", "decoder model"]),
    ("params CLI source-len 0", lambda e: cli("t5-small", "--source-len", 0), SystemExit, ["source_len", "0"]),
    # ---- the exercise checker: it must answer, never raise --------------------------------------------
    ("check NaN output", lambda e: check("01.attention", attention_answer(with_nan)), None,
     ["01.attention", "NaN at index (0, 1, 2)", "1 of", "was expected"]),
    ("check inf output", lambda e: check("01.attention", attention_answer(lambda o: o / 0)), None,
     ["inf at index", "was expected"]),
    ("check wrong dtype", lambda e: check("01.attention", attention_answer(lambda o: o.round().long())), None,
     ["expected dtype torch.float32", "torch.int64"]),
    ("check a tuple", lambda e: check("01.attention", attention_answer(lambda o: (o,))), None,
     ["expected a tensor of shape (2, 3, 5)", "tuple of 1 item"]),
    ("check a list", lambda e: check("01.attention", attention_answer(lambda o: o.tolist())), None,
     ["expected a tensor", "list of 2 item"]),
    ("check None", lambda e: check("01.attention", attention_answer(lambda o: None)), None,
     ["expected a tensor", "None", "return"]),
    ("check a generator", lambda e: check("01.attention", attention_answer(lambda o: (row for row in o))), None,
     ["expected a tensor", "generator", "torch.stack"]),
    ("check another device", lambda e: check("01.attention", attention_answer(lambda o: o.to("meta"))), None,
     ["expected a tensor on cpu", "meta"]),
    ("check a function that exits", lambda e: check("01.attention", attention_answer(lambda o: exit())), None,
     ["case 0 raised SystemExit"]),
    ("check a tensor, not a function", lambda e: check("01.attention", torch.zeros(2)), None,
     ["check takes your function itself", "tensor of shape (2,)"]),
]


def _filled_cache(e):
    cache = e.lm.new_cache()
    with torch.no_grad():
        e.lm(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    return cache


def test_the_table_covers_every_area_with_enough_rows():
    assert len(ROWS) >= 60, f"{len(ROWS)} rows"
    assert len({name for name, *_ in ROWS}) == len(ROWS), "two rows share a name"


@pytest.mark.parametrize("call,error,words", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_a_bad_call_gets_a_clear_answer(env, call, error, words):
    if error is None:
        message = str(call(env))  # must not raise
    else:
        with pytest.raises(error) as info:
            call(env)
        assert type(info.value) is error, f"raised {type(info.value).__name__}, expected {error.__name__}"
        message = str(info.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"the message lacks {missing}: {message}"
