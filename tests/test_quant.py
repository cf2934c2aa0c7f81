"""tutorial_lib.quant: the integer quantizers (error bounds, ranges, zero ranges, granularities,
bits per weight, bad input) and ggml's block encoders Q8_0, Q4_0, Q4_1 byte for byte against the
`gguf` package's numpy quantizer (ggml's reference, ported): random tensors of several shapes,
scales and dtypes, edge blocks (zeros, constants, outliers, float16 underflow and overflow of the
scale, one-signed blocks, exact ties), hand-worked bytes, and the bundled SmolLM2 file, whose
stored blocks the encoder reproduces from their own dequantized values."""

import numpy as np
import pytest
import torch

from tutorial_lib import gguf as ours_gguf
from tutorial_lib import pretrained, quant

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
KINDS = quant.BLOCK_KINDS


def reference(x: torch.Tensor, kind: str) -> torch.Tensor:
    """ggml's bytes for x, from the gguf package (numpy, float32 arithmetic like ggml's C)."""
    with np.errstate(over="ignore"):  # a float16 scale that overflows to inf is part of what is tested
        return torch.from_numpy(gguf.quants.quantize(x.numpy(), Q[kind]))


def reference_values(data: torch.Tensor, kind: str) -> torch.Tensor:
    with np.errstate(invalid="ignore"):  # inf * 0 in blocks whose scale overflowed
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data.numpy(), Q[kind])))


def bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int32 bit patterns: -0.0 differs from 0.0, equal NaNs compare equal."""
    return values.contiguous().view(torch.int32)


def scales_of(block_bytes: torch.Tensor) -> torch.Tensor:
    """The float16 d of every block (bytes 0-1), as float32."""
    return block_bytes[..., :2].contiguous().view(torch.float16).float()


def assert_same_bytes(x: torch.Tensor, kind: str) -> torch.Tensor:
    ours, ref = quant.quantize(x, kind), reference(x.float(), kind)
    assert ours.dtype == torch.uint8 and ours.shape == ref.shape
    assert torch.equal(ours, ref), f"{kind}: {(ours != ref).sum().item()} of {ours.numel()} bytes differ"
    return ours


# ---- ggml's block formats against gguf.quants ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(32,), (1, 32), (3, 64), (2, 5, 96), (300, 512)],
                         ids=["1-d", "one-block", "3x64", "3-d", "several-chunks"])
def test_bytes_equal_ggml_on_random_tensors(kind, shape):
    # (300, 512) is 4800 blocks: more than one CPU chunk of the encoder
    g = torch.Generator().manual_seed(sum(shape))
    for scale in (1e-3, 1.0, 50.0):
        x = torch.randn(shape, generator=g) * scale
        out = assert_same_bytes(x, kind)
        assert out.shape == (*shape[:-1], shape[-1] // 32 * quant.BLOCK_BYTES[kind])
    heavy = torch.randn(shape, generator=g) ** 3  # heavy tails: an outlier in most blocks
    assert_same_bytes(heavy, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_are_quantized_from_their_float32(kind, dtype):
    x = torch.randn(4, 64, dtype=torch.float64).to(dtype)
    ours = quant.quantize(x, kind)
    assert torch.equal(ours, reference(x.float(), kind))  # gguf too converts to float32 first
    with np.errstate(over="ignore"):
        assert torch.equal(ours, torch.from_numpy(gguf.quants.quantize(x.double().numpy(), Q[kind])))


def edge_blocks() -> dict[str, torch.Tensor]:
    """Named (rows, 32) tensors of blocks that a scale formula could get wrong."""
    g = torch.Generator().manual_seed(7)
    r = torch.randn(4, 32, generator=g)
    outlier = r.clone()
    outlier[:, 5] = 1e4
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.49999997, -0.49999997,
                         0.50000006, 10.5, 11.5, -10.5, -11.5] + [0.0] * 15 + [127.0])
    return {
        "zeros": torch.zeros(2, 32),
        "constant+": torch.full((2, 32), 3.25),
        "constant-": torch.full((2, 32), -0.7),
        "outlier": outlier,
        "tiny 1e-6": r * 1e-6,  # Q8_0's d = 7.9e-9 underflows float16 to 0
        "tiny 1e-5": r * 1e-5,  # d near 1e-7 - 1e-6: a float16 subnormal
        "tiny 1e-3": r * 1e-3,
        "huge 1e6": r * 1e6,  # Q4_0's d = max / 8 and Q4_1's (max - min) / 15 exceed 65504
        "huge 1e7": r * 1e7,  # so does Q8_0's max / 127
        "positive only": r.abs() + 0.1,
        "negative only": -r.abs() - 0.1,
        "ties": ties.reshape(1, 32),
        "ties 4-bit": torch.tensor([-8.0, 7.0, -7.5, -6.5, -0.5, 0.5, 1.5, 6.5] + [0.0] * 24).reshape(1, 32),
        "+m before -m": torch.tensor([0.0, 2.0, -2.0] + [1.0] * 29).reshape(1, 32),
        "-m before +m": torch.tensor([0.0, -2.0, 2.0] + [1.0] * 29).reshape(1, 32),
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(edge_blocks()))
def test_bytes_and_values_equal_ggml_on_edge_blocks(kind, name):
    x = edge_blocks()[name]
    ours = assert_same_bytes(x, kind)
    # reading back: the same bits as gguf's own dequantizer (NaN where an inf scale meets q = 0)
    assert torch.equal(bits(quant.dequantize(ours, kind)), bits(reference_values(ours, kind)))
    values = quant.dequantize(ours, kind)
    if name in ("zeros", "constant+", "constant-", "positive only", "negative only", "ties", "outlier"):
        assert torch.isfinite(values).all()
    if name == "zeros":
        assert torch.equal(values, torch.zeros_like(x))


def test_what_ggml_does_with_scales_outside_float16():
    huge, tiny = edge_blocks()["huge 1e6"], edge_blocks()["tiny 1e-6"]
    # Q4_0 and Q4_1: d rounds to +-inf in float16, as in gguf; the values read back are inf or NaN
    for kind in ("Q4_0", "Q4_1"):
        d = scales_of(quant.quantize(huge, kind))
        assert torch.isinf(d).all()
    assert torch.isfinite(scales_of(quant.quantize(huge, "Q8_0"))).all()  # 1e6 * ~3 / 127 fits float16
    # Q8_0 on ~1e-6: d = max|x| / 127 < float16's smallest subnormal: stored as 0, everything reads as 0,
    # although the integers were computed from the float32 d and are not 0
    stored = quant.quantize(tiny, "Q8_0").reshape(-1, 34)
    assert torch.equal(scales_of(stored), torch.zeros(len(stored), 1))
    assert stored[:, 2:].view(torch.int8).abs().amax() == 127
    assert torch.equal(quant.dequantize(stored, "Q8_0"), torch.zeros(stored.size(0), 32))
    # ~1e-5: d is a float16 subnormal (nonzero, below 6.1e-5)
    d = scales_of(quant.quantize(edge_blocks()["tiny 1e-5"], "Q8_0"))
    assert ((d > 0) & (d < 6.1e-5)).all()


def test_hand_worked_blocks():
    # Q8_0: max|x| = 127 -> d = 1.0 (float16 bytes 00 3C); ties round away from zero
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([127.0, 0.5, -1.5, 2.5, 0.49999997])
    out = quant.quantize(x, "Q8_0")
    assert out[0, :2].tolist() == [0x00, 0x3C]
    assert out[0, 2:7].view(torch.int8).tolist() == [127, 1, -2, 3, 0]
    # Q4_0: the signed extreme -8 gives d = -8 / -8 = 1; code = trunc(x + 8.5): -8 -> 0, 7 -> 15, 0 -> 8;
    # byte j holds element j (low nibble) and element j + 16 (high nibble)
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 16], x[0, 17] = -8.0, 7.0, 7.0, -8.0
    out = quant.quantize(x, "Q4_0")
    assert out[0, :2].tolist() == [0x00, 0x3C]
    assert out[0, 2:5].tolist() == [0 | 15 << 4, 15 | 0 << 4, 8 | 8 << 4]
    # a positive extreme gives a negative d: +8 lands on code 0 as well
    assert scales_of(quant.quantize(-x, "Q4_0")).item() == -1.0
    # Q4_1: min -1, max 14 -> d = 1, m = -1 (float16 00 BC); code = trunc(x - min + 0.5)
    x = torch.full((1, 32), 2.0)
    x[0, 0], x[0, 1] = -1.0, 14.0
    out = quant.quantize(x, "Q4_1")
    assert out[0, :4].tolist() == [0x00, 0x3C, 0x00, 0xBC]
    assert out[0, 4:6].tolist() == [0 | 3 << 4, 15 | 3 << 4]


def test_q4_0_takes_the_first_of_two_equal_magnitudes():
    first_positive = edge_blocks()["+m before -m"]
    first_negative = edge_blocks()["-m before +m"]
    assert scales_of(quant.quantize(first_positive, "Q4_0")).item() == -0.25  # 2 / -8
    assert scales_of(quant.quantize(first_negative, "Q4_0")).item() == 0.25  # -2 / -8


def test_rounding_helper_is_ggml_roundf_near_every_tie():
    # every float32 within 64 ulps of k + 0.5 for k in 0..127, both signs, against gguf's np_roundf
    centres = torch.arange(128, dtype=torch.float32) + 0.5
    pattern = centres.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)
    v = pattern.view(torch.float32).flatten()
    v = torch.cat([v, -v, torch.rand(10000) * 300 - 150])
    expected = torch.from_numpy(gguf.quants.np_roundf(v.numpy()))
    assert torch.equal(quant._round_half_away(v), expected)
    assert not torch.equal(torch.round(v), expected)  # torch.round sends ties to even: not the same


def test_dequantize_is_the_gguf_module_reader():
    x = torch.randn(3, 64)
    for kind in KINDS:
        q = quant.quantize(x, kind)
        assert torch.equal(bits(quant.dequantize(q, kind)), bits(ours_gguf.dequantize(q, kind)))
        assert quant.dequantize(q, kind).shape == x.shape


def test_block_encoders_refuse_bad_input():
    with pytest.raises(ValueError, match=r"blocks of 32 values; got rows of 33 values \(shape \(2, 33\)\)"):
        quant.quantize(torch.randn(2, 33), "Q8_0")
    with pytest.raises(ValueError, match=r"one of the block types Q8_0, Q4_0, Q4_1, got 'Q5_0'"):
        quant.quantize(torch.randn(2, 32), "Q5_0")
    with pytest.raises(ValueError, match=r"got 'q8_0'"):
        quant.quantize(torch.randn(2, 32), "q8_0")
    with pytest.raises(ValueError, match=r"got 'F32'"):
        quant.dequantize(torch.zeros(2, 4, dtype=torch.uint8), "F32")
    bad = torch.randn(2, 64)
    bad[1, 40] = float("nan")
    with pytest.raises(ValueError, match=r"finite values; it has 1 that are not .* at index \(1, 40\): nan"):
        quant.quantize(bad, "Q4_0")
    bad[1, 40], bad[0, 3] = 1.0, float("-inf")
    with pytest.raises(ValueError, match=r"at index \(0, 3\): -inf"):
        quant.quantize(bad, "Q4_1")
    with pytest.raises(ValueError, match=r"overflows float32"):
        quant.quantize(torch.full((1, 32), 1e300, dtype=torch.float64), "Q8_0")
    with pytest.raises(ValueError, match=r"floating-point tensor, got dtype torch.int64"):
        quant.quantize(torch.ones(2, 32, dtype=torch.int64), "Q8_0")
    with pytest.raises(ValueError, match=r"torch.Tensor, got ndarray"):
        quant.quantize(np.zeros((2, 32), np.float32), "Q8_0")
    with pytest.raises(ValueError, match=r"0-d tensor"):
        quant.quantize(torch.tensor(1.0), "Q8_0")


# ---- the bundled file ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    try:
        path = pretrained.bundled_gguf()
    except ValueError as err:
        pytest.skip(str(err))
    with ours_gguf.read(path) as f:
        yield f


def test_requantizing_the_bundled_file_gives_its_stored_bytes(bundled):
    # Q8_0: each stored block has some |q| = 127 (that is how d was chosen), so its largest value
    # read back is d16 * 127 (exact in float32) and d16 * 127 / 127 = d16 exactly: the same d, the same q.
    rows = slice(0, 1024)  # of the (49152, 576) tied embedding: enough blocks, fast
    embedding = bundled.tensor("token_embd.weight")[rows]
    assert bundled.info("token_embd.weight").type_name == "Q8_0"
    assert torch.equal(quant.quantize(embedding, "Q8_0"), bundled.raw("token_embd.weight")[rows])
    # Q4_1: the file was written by ggml's reference quantizer (no importance matrix), so each block
    # holds codes 0 and 15; read back, its minimum is m16 exactly and its maximum d16 * 15 + m16 up to
    # float32 rounding, far below a float16 step: the same d and m come back, and the same codes.
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.attn_v.weight"):
        info = bundled.info(name)
        assert info.type_name == "Q4_1"
        stored = bundled.raw(name)
        codes = stored.reshape(-1, 20)[:, 4:]
        codes = torch.cat([codes & 15, codes >> 4], dim=1)
        assert (codes.amin(dim=1) == 0).all() and (codes.amax(dim=1) == 15).all()
        assert torch.equal(quant.quantize(bundled.tensor(name), "Q4_1"), stored)


def test_bundled_weights_to_other_kinds_equal_ggml(bundled):
    weight = bundled.tensor("blk.3.attn_k.weight")  # (192, 576), from Q4_1
    embedding = bundled.tensor("token_embd.weight")[:256]  # from Q8_0: many blocks with +m and -m both there
    for x in (weight, embedding):
        for kind in KINDS:
            ours = assert_same_bytes(x, kind)
            assert torch.equal(bits(quant.dequantize(ours, kind)), bits(reference_values(ours, kind)))


# ---- integer quantization ------------------------------------------------------------------------


def per_value(q: quant.Quantized, values: torch.Tensor) -> torch.Tensor:
    """A per-group tensor (scale or minimum) spread to the shape of q, one entry per value."""
    groups = quant._groups(q.q, q.granularity, q.block_size)
    return values.reshape(-1, 1).expand(groups.shape).reshape(q.q.shape)


GRANULARITIES = [("tensor", None), ("channel", None), ("block", 32), ("block", 16)]


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("granularity, block_size", GRANULARITIES)
@pytest.mark.parametrize("n_bits", [2, 3, 4, 8])
def test_error_is_at_most_half_a_step_and_codes_stay_in_range(symmetric, granularity, block_size, n_bits):
    x = torch.randn(6, 64) * torch.linspace(0.1, 5, 6)[:, None]  # rows of different sizes
    quantize = quant.quantize_symmetric if symmetric else quant.quantize_asymmetric
    q = quantize(x, n_bits, granularity, block_size or 32)
    assert q.block_size == block_size and q.granularity == granularity and q.bits == n_bits
    expected_scales = {"tensor": (), "channel": (6,), "block": (6, 64 // (block_size or 1))}[granularity]
    assert q.scale.shape == expected_scales and q.scale.dtype == torch.float32
    values = q.dequantize()
    assert values.shape == x.shape and values.dtype == torch.float32
    step = per_value(q, q.scale)
    assert ((x - values).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    groups = quant._groups(q.q, granularity, block_size).long()
    if symmetric:
        assert q.q.dtype == torch.int8 and q.minimum is None
        qmax = 2 ** (n_bits - 1) - 1
        # the range is -qmax..qmax, and the largest |x| of each group lands on +-qmax exactly
        assert (groups.abs().amax(dim=1) == qmax).all()
    else:
        assert q.q.dtype == torch.uint8 and q.minimum.shape == q.scale.shape
        # each group's minimum is code 0 and its maximum code 2**bits - 1; the minimum reads back exactly
        assert (groups.amin(dim=1) == 0).all() and (groups.amax(dim=1) == 2 ** n_bits - 1).all()
        at_minimum = x == per_value(q, q.minimum)
        assert torch.equal(values[at_minimum], x[at_minimum])
    assert torch.equal(quant.round_trip(x, n_bits, granularity, symmetric=symmetric, block_size=block_size or 32),
                       values)


def test_rounding_is_to_nearest_even_and_values_are_scale_times_q():
    x = torch.tensor([0.5, 1.5, 2.5, -2.5, 3.0, 7.0])  # per tensor, 4 bits: scale = 7 / 7 = 1
    q = quant.quantize_symmetric(x, 4, "tensor")
    assert q.scale.item() == 1.0
    assert q.q.tolist() == [0, 2, 2, -2, 3, 7]
    assert torch.equal(q.dequantize(), torch.tensor([0.0, 2.0, 2.0, -2.0, 3.0, 7.0]))
    a = quant.quantize_asymmetric(torch.tensor([1.0, 1.5, 2.5, 4.0]), 2, "tensor")  # scale (4 - 1) / 3 = 1
    assert a.q.tolist() == [0, 0, 2, 3] and a.minimum.item() == 1.0
    assert torch.equal(a.dequantize(), torch.tensor([1.0, 1.0, 3.0, 4.0]))


def test_smaller_groups_confine_an_outlier():
    x = torch.randn(8, 256)
    x[2, 70] = 80.0
    for symmetric in (True, False):
        errors = {g: (quant.round_trip(x, 4, g, symmetric=symmetric) - x).pow(2).mean().item()
                  for g in ("tensor", "channel", "block")}
        assert errors["block"] < errors["channel"] < errors["tensor"]
        assert errors["block"] < errors["tensor"] / 10
        # per block, only the outlier's own 32 values pay for it: the other blocks of its row do not
        error = (quant.round_trip(x, 4, "block", symmetric=symmetric) - x).abs()
        clean = torch.randn(8, 256).abs().amax()  # a typical block's range, for scale
        assert error[2, :64].max() < clean / 7 and error[2, 96:].max() < clean / 7
        assert error[2, 64:96].max() > error[2, 96:].max()


def test_zero_and_constant_groups_give_no_nan():
    zeros = torch.zeros(4, 64)
    for granularity in ("tensor", "channel", "block"):
        for quantize in (quant.quantize_symmetric, quant.quantize_asymmetric):
            q = quantize(zeros, 4, granularity)
            assert torch.equal(q.dequantize(), zeros) and (q.scale == 0).all()
    constant = torch.full((2, 64), -1.75)
    constant[1] = 3.0
    # asymmetric: scale 0, code 0, read back as the minimum: exactly
    assert torch.equal(quant.round_trip(constant, 3, "channel", symmetric=False), constant)
    # symmetric: every value is the absmax, so q = +-qmax and the value is (c / qmax) * qmax
    q = quant.quantize_symmetric(constant, 3, "channel")
    assert q.q[0].eq(-3).all() and q.q[1].eq(3).all()
    assert torch.allclose(q.dequantize(), constant, rtol=1e-6, atol=0)
    mixed = torch.randn(2, 64)
    mixed[0, :32] = 0.0  # one all-zero block next to ordinary ones
    for quantize in (quant.quantize_symmetric, quant.quantize_asymmetric):
        values = quantize(mixed, 4).dequantize()
        assert torch.isfinite(values).all() and torch.equal(values[0, :32], torch.zeros(32))


def test_bits_per_weight_counts_the_scales_at_16_bits():
    x = torch.randn(64, 128)
    assert quant.quantize_symmetric(x, 4).bits_per_weight == 4.5  # as Q4_0
    assert quant.quantize_asymmetric(x, 4).bits_per_weight == 5.0  # as Q4_1
    assert quant.quantize_symmetric(x, 8).bits_per_weight == 8.5  # as Q8_0
    assert quant.quantize_symmetric(x, 4, block_size=64).bits_per_weight == 4.25
    assert quant.quantize_symmetric(x, 3, "channel").bits_per_weight == 3 + 16 / 128
    assert quant.quantize_asymmetric(x, 2, "channel").bits_per_weight == 2 + 32 / 128
    assert quant.quantize_symmetric(x, 4, "tensor").bits_per_weight == 4 + 16 / x.numel()
    # and the ggml kinds occupy those bits in bytes: 8.5, 4.5 and 5 bits a value
    for kind, bpw in (("Q8_0", 8.5), ("Q4_0", 4.5), ("Q4_1", 5.0)):
        assert quant.quantize(x, kind).numel() * 8 / x.numel() == bpw


def test_integer_quantizers_refuse_bad_input():
    x = torch.randn(4, 64)
    for n_bits, shown in ((1, "1"), (9, "9"), (16, "16"), (4.0, r"4\.0"), (True, "True")):
        with pytest.raises(ValueError, match=rf"bits must be an int in \[2, 8\].*got {shown}"):
            quant.quantize_symmetric(x, n_bits)
    with pytest.raises(ValueError, match=r"granularity must be one of 'tensor', 'channel', 'block', got 'row'"):
        quant.quantize_asymmetric(x, 4, "row")
    with pytest.raises(ValueError, match=r"whole blocks of block_size=48; got rows of 64 values"):
        quant.quantize_symmetric(x, 4, "block", 48)
    with pytest.raises(ValueError, match=r"block_size must be a positive int"):
        quant.round_trip(x, 4, block_size=0)
    quant.quantize_symmetric(x, 4, "channel", block_size=48)  # a block size matters only per block
    with pytest.raises(ValueError, match=r"floating-point tensor, got dtype torch.int32"):
        quant.quantize_symmetric(x.int(), 4)
    x[3, 1] = float("inf")
    with pytest.raises(ValueError, match=r"at index \(3, 1\): inf"):
        quant.quantize_asymmetric(x, 4)
