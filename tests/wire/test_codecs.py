"""Wire codecs: round trips within each codec's stated bound (random data with outliers, GPT-2
activations), exact payload sizes that ignore the input dtype, zeros, determinism, when a codec
applies, compression ratios, the registry, and Triton kernels writing the torch path's bytes (on CPU
through TRITON_INTERPRET=1; on a GPU in the ``gpu`` tier).
"""

from __future__ import annotations

import math

import pytest
import torch

from hetcc.errors import PlanFormatError, RuntimeFailure
from hetcc.wire import CODECS, MIN_CODED_ELEMENTS, get_codec, within_budget
from hetcc.wire import quantize as wire_quantize
from hetcc.wire.layout import matrix_shape
from hetcc.wire.lowrank import rank
from hetcc.wire.quantize import hadamard

SHAPES = [(4, 16, 96), (7, 333), (2331,)]  # the last two: ragged last tile, odd n


def with_outliers(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """randn with every 97th element 40 times larger and a run of tiny and zero values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    flat[::97] *= 40
    flat[:50] *= 1e-3
    flat[50:60] = 0
    return x.to(dtype)


def round_trip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(x), x.shape, x.dtype)


def max_error(name: str, x: torch.Tensor) -> float:
    return float((round_trip(name, x).double() - x.double()).abs().max())


@pytest.fixture(scope="module")
def gpt2_activations() -> torch.Tensor:
    """last_hidden_state [2, 32, 64] of a randomly initialised one-block GPT-2 on random tokens."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = GPT2Model(config).eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(CODECS))
def test_round_trip_is_within_the_stated_bound(name, shape):
    x = with_outliers(shape)
    assert max_error(name, x) <= get_codec(name).error_bound(x)


@pytest.mark.parametrize("name", list(CODECS))
def test_round_trip_of_bf16_input_is_within_the_bound_and_comes_back_bf16(name):
    x = with_outliers((4, 16, 96), seed=1, dtype=torch.bfloat16)
    assert round_trip(name, x).dtype == torch.bfloat16
    assert max_error(name, x) <= get_codec(name).error_bound(x)


@pytest.mark.parametrize("name", list(CODECS))
def test_gpt2_activations_round_trip_within_the_bound(name, gpt2_activations):
    x = gpt2_activations
    assert max_error(name, x) <= get_codec(name).error_bound(x)


# error_bound / absmax(x) no codec may exceed: a bound is a claim about quality, not just any number
BOUND_CEILING = {
    "none": 2**-22,
    "bf16": 2**-8 + 2**-20,  # half an ulp of 8 significant bits
    "fp16": 2**-11 + 2**-20,
    "int8": 1 / 250,
    "int8-hadamard": math.sqrt(128) / 250 + 2**-8,
    "fp8": 2**-4 + 2**-14,
    "int4": 1 / 13.5,
    "int4-hadamard": math.sqrt(128) / 13.5 + 2**-8,
}


@pytest.mark.parametrize("name", list(BOUND_CEILING))
def test_bounds_are_tight_enough_to_mean_something(name, gpt2_activations):
    x = gpt2_activations
    assert get_codec(name).error_bound(x) <= BOUND_CEILING[name] * float(x.abs().max())


def relative_frobenius(approx: torch.Tensor, m: torch.Tensor) -> float:
    return float(torch.linalg.norm(approx - m) / torch.linalg.norm(m))


def best_rank_r_error(m: torch.Tensor, r: int) -> float:
    u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
    return relative_frobenius(((u[:, :r] * s[:r]) @ vh[:r]).float(), m)


def low_rank_plus_noise(rows: int, d: int, true_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    signal = torch.randn(rows, true_rank, generator=g) @ torch.randn(true_rank, d, generator=g)
    return signal + 0.05 * torch.randn(rows, d, generator=g)


@pytest.mark.parametrize("source", ["low-rank-plus-noise", "gpt2"])
def test_lowrank_frobenius_error_is_near_the_best_rank_r(source, gpt2_activations):
    x = low_rank_plus_noise(256, 96, 6) if source != "gpt2" else gpt2_activations
    rows, d = matrix_shape(x.shape)
    approx = round_trip("lowrank", x).view(rows, d)
    m = x.view(rows, d)
    best = best_rank_r_error(m, rank(x.shape))
    assert relative_frobenius(approx, m) <= 1.5 * best + 1e-6
    if source != "gpt2":
        assert best < 0.05  # the data is what it claims: rank 6 = ceil(96 / 16) explains it


def test_hadamard_is_orthonormal_and_spreads_an_outlier():
    h = hadamard(torch.device("cpu"))
    torch.testing.assert_close(h @ h, torch.eye(128), atol=1e-6, rtol=0)
    assert torch.all(h.abs() == h[0, 0].abs())
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    x[:, 7] = 100.0  # one outlier per tile sets the plain int8 scale
    assert max_error("int8-hadamard", x) < 0.5 * max_error("int8", x)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("shape", [(4, 16, 96), (2331,)])
def test_payload_size_depends_on_the_shape_only(name, shape):
    codec = get_codec(name)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        payload = codec.encode(with_outliers(shape, dtype=dtype))
        assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.is_contiguous()
        assert payload.numel() == codec.payload_bytes(shape)
        out = codec.decode(payload, shape, dtype)
        assert out.shape == shape and out.dtype == dtype


@pytest.mark.parametrize("name", list(CODECS))
def test_zero_payload_decodes_to_exact_zeros(name):
    codec, shape = get_codec(name), (4, 16, 96)
    zero = torch.zeros(codec.payload_bytes(shape), dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(codec.decode(zero, shape, dtype), torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("name", list(CODECS))
def test_zero_input_round_trips_to_zeros(name):
    x = torch.zeros(4, 16, 96)
    payload = get_codec(name).encode(x)
    assert not torch.isnan(payload.view(-1)).any()
    assert torch.equal(round_trip(name, x), x)


@pytest.mark.parametrize("name", list(CODECS))
def test_encode_is_deterministic_and_outside_autograd(name):
    codec = get_codec(name)
    x = with_outliers((4, 16, 96)).requires_grad_()
    first, second = codec.encode(x), codec.encode(x.detach().clone())
    assert torch.equal(first, second)
    assert not first.requires_grad and first.grad_fn is None
    decoded = codec.decode(first, x.shape, x.dtype)
    assert not decoded.requires_grad
    with torch.no_grad():  # nothing aliases: the runtime reuses its send and receive buffers
        x.zero_()
        assert torch.equal(first, second)
        first.zero_()
    assert decoded.abs().sum() > 0


def test_applies_only_where_a_floating_tensor_shrinks():
    big = (8, 16, 96)
    assert all(get_codec(n).applies(big, torch.float32) for n in CODECS if n != "none")
    assert not any(c.applies(big, dtype) for c in CODECS.values() for dtype in (torch.int64, torch.int8))
    assert not any(c.applies(big, torch.complex64) for c in CODECS.values())
    assert not any(c.applies((MIN_CODED_ELEMENTS - 1,), torch.float32) for c in CODECS.values())
    assert get_codec("int8").applies((MIN_CODED_ELEMENTS,), torch.float32)
    assert not get_codec("none").applies(big, torch.float64)
    assert not get_codec("bf16").applies(big, torch.bfloat16)  # 2n bytes are not fewer than 2n
    assert get_codec("bf16").applies(big, torch.float32) and get_codec("int8").applies(big, torch.bfloat16)
    # 7 rows: rank 7 (capped by the rows) needs 7 * (7 + 333) numbers for 7 * 333
    assert not get_codec("lowrank").applies((7, 333), torch.float64)


# payload / raw fp32 bytes on [8, 128, 768]: 1/4 + one fp32 scale per 128 elements, and so on
RATIOS = {
    "bf16": 0.5,
    "fp16": 0.5,
    "int8": 1 / 4 + 1 / 128,
    "int8-hadamard": 1 / 4 + 1 / 128,
    "fp8": 1 / 4 + 1 / 768,
    "int4": 1 / 8 + 1 / 128,
    "int4-hadamard": 1 / 8 + 1 / 128,
    "lowrank": 48 * (1024 + 768) / (1024 * 768),
}


def test_compression_ratios():
    shape = (8, 128, 768)
    raw = 4 * math.prod(shape)
    for name, ratio in RATIOS.items():
        assert get_codec(name).payload_bytes(shape) / raw == pytest.approx(ratio, rel=1e-9)
    assert 0.257 < RATIOS["int8"] < 0.259 and 0.132 < RATIOS["int4"] < 0.134


def test_work_prices_reading_fp32_and_writing_the_payload():
    shape = (8, 128, 768)
    for codec in CODECS.values():
        flops, moved = codec.work(shape)
        assert moved == 4 * math.prod(shape) + codec.payload_bytes(shape)
        assert flops >= 0
    assert get_codec("int8-hadamard").work(shape)[0] > 20 * get_codec("int8").work(shape)[0]
    assert get_codec("lowrank").work(shape)[0] > get_codec("int8").work(shape)[0]


def test_registry_names_and_budget_order():
    with pytest.raises(PlanFormatError) as info:
        get_codec("int3")
    assert all(name in str(info.value) for name in CODECS)
    assert not within_budget("int4", "int8") and within_budget("bf16", "int8")
    assert within_budget("int8-hadamard", "int8") and within_budget("none", "none")
    order = sorted(CODECS, key=lambda n: CODECS[n].loss_rank)
    assert order[0] == "none" and order[-1] == "lowrank"
    assert [CODECS[n].loss_rank for n in ("bf16", "int8", "fp8", "int4")] == [1, 2, 3, 4]


def test_wrong_payload_and_integer_input_are_hetcc_errors():
    codec = get_codec("int8")
    with pytest.raises(RuntimeFailure, match="expects a 1-D uint8 payload"):
        codec.decode(torch.zeros(10, dtype=torch.uint8), (4, 16, 96), torch.float32)
    with pytest.raises(PlanFormatError, match="floating-point"):
        codec.encode(torch.ones(2048, dtype=torch.int64))


# --- Triton kernels: the same bytes as the torch path --------------------------------------------

TRITON_CODECS = ["int8", "int4", "fp8"]
TRITON_SHAPES = [(4, 16, 96), (7, 333), (2331,), (3, 5, 1)]


def fp8_ties_row() -> torch.Tensor:
    """448 (so the row's scale is 448 * fp32(1/448) = 1) and every midpoint between neighbouring
    e4m3 values, both signs: where round-to-nearest-even is decided."""
    codes = torch.arange(0, 0x7E, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    return torch.cat([torch.tensor([448.0]), mids, -mids, torch.tensor([-0.0])])


def triton_payload(name: str, x: torch.Tensor) -> torch.Tensor:
    from hetcc.wire import triton_codecs

    flat = x.reshape(-1).contiguous()
    if name == "fp8":
        return triton_codecs.encode_rows_fp8(flat, *matrix_shape(x.shape))
    return triton_codecs.encode_tiles(flat, 8 if name == "int8" else 4)


def triton_decode(name: str, payload: torch.Tensor, shape) -> torch.Tensor:
    from hetcc.wire import triton_codecs

    if name == "fp8":
        return triton_codecs.decode_rows_fp8(payload, *matrix_shape(shape))
    return triton_codecs.decode_tiles(payload, math.prod(shape), 8 if name == "int8" else 4)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", TRITON_CODECS)
def test_triton_kernels_write_the_torch_bytes_and_decode_the_same(name):
    cases = [with_outliers(s, seed=i) for i, s in enumerate(TRITON_SHAPES)]
    cases += [with_outliers((4, 16, 96), dtype=torch.bfloat16), fp8_ties_row(), torch.zeros(300)]
    for x in cases:
        reference = get_codec(name).encode(x)
        assert torch.equal(triton_payload(name, x), reference), (name, x.shape, x.dtype)
        want = get_codec(name).decode(reference, x.shape, torch.float32).reshape(-1)
        assert torch.equal(triton_decode(name, reference, x.shape).view(torch.int32), want.view(torch.int32))
    zero = torch.zeros(get_codec(name).payload_bytes((7, 333)), dtype=torch.uint8)
    assert torch.equal(triton_decode(name, zero, (7, 333)), torch.zeros(7 * 333))


@pytest.mark.usefixtures("interpreter")
def test_codecs_send_tensors_the_kernels_serve_through_them(monkeypatch):
    """With the Triton path chosen (as for a CUDA tensor), Codec.encode/decode give the same results."""
    x = with_outliers((7, 333))
    expected = {name: (get_codec(name).encode(x), round_trip(name, x)) for name in TRITON_CODECS}
    from hetcc.wire import triton_codecs

    calls = []
    for kernel in ("encode_tiles", "decode_tiles", "encode_rows_fp8", "decode_rows_fp8"):
        real = getattr(triton_codecs, kernel)
        monkeypatch.setattr(triton_codecs, kernel, lambda *a, _f=real, _k=kernel: calls.append(_k) or _f(*a))
    monkeypatch.setattr(wire_quantize, "runs_triton", lambda t: True)
    for name, (payload, decoded) in expected.items():
        assert torch.equal(get_codec(name).encode(x), payload)
        assert torch.equal(round_trip(name, x), decoded)
    assert sorted(set(calls)) == ["decode_rows_fp8", "decode_tiles", "encode_rows_fp8", "encode_tiles"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TRITON_CODECS)
def test_gpu_kernels_write_the_cpu_bytes(name):
    for i, shape in enumerate([(8, 128, 768), (7, 333), (2331,)]):
        x = with_outliers(shape, seed=i)
        cpu = get_codec(name).encode(x)
        gpu = get_codec(name).encode(x.cuda())
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu), (name, shape)
        decoded = get_codec(name).decode(gpu, shape, torch.float32)
        assert torch.equal(decoded.cpu(), get_codec(name).decode(cpu, shape, torch.float32))


def test_non_finite_values_reach_the_receiver_as_non_finite():
    """An fp16 loss scaler must see an overflow: fp16 keeps inf, the tiled and low-rank codecs give NaN."""
    x = torch.randn(64, 64)
    x[3, 3] = float("inf")
    for name in ("fp16", "bf16", "int8", "int4", "fp8", "lowrank"):
        codec = get_codec(name)
        assert not torch.isfinite(codec.decode(codec.encode(x), x.shape, x.dtype)).all(), name
