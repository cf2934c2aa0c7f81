"""What only a CUDA GPU can check: the model gives the CPU's answers there, mixed precision
(bf16 autocast, fp16 with a gradient scaler) trains, the KV cache stays exact, and the GPU
setting is the one picked. Skipped where there is no GPU (CI has none); run on a GPU with
``pytest tests/test_cuda.py``."""

from dataclasses import replace

import pytest
import torch

from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.data import lm_batch
from tutorial_lib.device import default_precision, pick_device, pick_setting
from tutorial_lib.fast_decode import fast_decoder
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.sampling import generate
from tutorial_lib.train import make_optimizer, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
FLAVOURS = {"gpt": GPT_TINY, "llama": LLAMA_TINY}


def small(cfg):
    return replace(cfg, vocab_size=50, d_model=64, n_layers=2, n_heads=4, max_len=32, dropout=0.0)


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """fp32 products in full precision (no TF32), so CPU and GPU agree to float32 rounding."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_the_gpu_is_picked_with_its_setting_and_precision():
    assert pick_device().type == "cuda"
    assert pick_setting(cpu=dict(steps=10), gpu=dict(steps=100)) == dict(steps=100)
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    assert default_precision(CUDA) == expected


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_model_gives_the_cpus_logits_and_gradients_on_the_gpu(flavour):
    torch.manual_seed(0)
    cpu_model = DecoderOnlyLM(small(FLAVOURS[flavour]))
    gpu_model = DecoderOnlyLM(small(FLAVOURS[flavour])).to(CUDA)
    gpu_model.load_state_dict(cpu_model.state_dict())
    ids = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(1))
    cpu_out, gpu_out = cpu_model(ids[:, :-1], ids[:, 1:]), gpu_model(ids[:, :-1].to(CUDA), ids[:, 1:].to(CUDA))
    torch.testing.assert_close(gpu_out.logits.cpu(), cpu_out.logits, atol=1e-4, rtol=1e-4)
    cpu_out.loss.backward()
    gpu_out.loss.backward()
    for (name, p_cpu), p_gpu in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cached_generation_equals_recomputation_on_the_gpu(flavour):
    torch.manual_seed(0)
    model = DecoderOnlyLM(small(FLAVOURS[flavour])).to(CUDA).eval()
    prompt = torch.randint(0, 50, (2, 5), device=CUDA)
    cached, cached_logits = generate(model, prompt, 40, use_cache=True, return_logits=True)  # past max_len too
    plain, plain_logits = generate(model, prompt, 40, use_cache=False, return_logits=True)
    assert torch.equal(cached, plain), "cached and recomputed generation chose different tokens on the GPU"
    torch.testing.assert_close(cached_logits, plain_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fast_decoder_steps_match_the_modules_on_the_gpu(flavour):
    torch.manual_seed(0)
    model = DecoderOnlyLM(small(FLAVOURS[flavour])).to(CUDA).eval()
    prompt = torch.randint(0, 50, (2, 5), device=CUDA)
    assert fast_decoder(model) is not None
    fast, fast_logits = generate(model, prompt, 20, return_logits=True, fast=True)
    slow, slow_logits = generate(model, prompt, 20, return_logits=True)  # the default: the modules
    assert torch.equal(fast, slow), "FastDecoder and the modules chose different tokens on the GPU"
    # bit for bit on the CPU (tests/test_fast_decode.py); on a GPU a library may pick another
    # kernel for (B, d) than for (B, 1, d) inputs, so only float32 rounding is asked for here
    torch.testing.assert_close(fast_logits, slow_logits, atol=1e-5, rtol=1e-5)


def fit(precision, flavour="gpt", steps=150):
    """Train a small model on a stream with one repeating pattern; return the History."""
    torch.manual_seed(0)
    model = DecoderOnlyLM(small(FLAVOURS[flavour])).to(CUDA)
    stream = torch.arange(50).repeat(40)  # 0, 1, ..., 49, 0, 1, ...: the next token is certain
    data = torch.Generator().manual_seed(0)
    return train(model, lambda i: lm_batch(stream, 16, 24, data, CUDA), steps,
                 optimizer=make_optimizer(model, 3e-3), precision=precision, progress=False)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_as_well_as_fp32(precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    reference, mixed = fit("fp32"), fit(precision)
    start = mixed.loss[0]
    assert start > 3.5, f"an untrained model should be near ln 50 = 3.9, got {start:.2f}"
    assert all(torch.isfinite(torch.tensor(mixed.loss))), f"{precision} training produced a non-finite loss"
    # the pattern is learnable: both runs end far below the start, and within 0.05 nats of each other
    assert reference.loss[-1] < 0.1 and mixed.loss[-1] < 0.1, (reference.loss[-1], mixed.loss[-1])
    assert abs(sum(mixed.loss[-10:]) / 10 - sum(reference.loss[-10:]) / 10) < 0.05


def test_bf16_autocast_keeps_the_llama_flavour_finite():
    history = fit("bf16", flavour="llama", steps=60)
    first, last = history.loss[0], history.loss[-1]
    assert last < first - 1.0, f"bf16 LLaMA did not learn: {first:.2f} -> {last:.2f}"


def test_the_gpu_settings_of_the_notebooks_build_on_the_gpu():
    """The GPU setting of notebook 06 builds a model that runs a training step on the GPU."""
    cfg = replace(GPT_TINY, vocab_size=100, d_model=256, n_layers=6, n_heads=8, max_len=128)
    model = DecoderOnlyLM(cfg).to(CUDA)
    ids = torch.randint(0, 100, (32, 129), device=CUDA)
    loss = model(ids[:, :-1], ids[:, 1:]).loss
    loss.backward()
    finite = torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert finite, "non-finite loss or gradient"
