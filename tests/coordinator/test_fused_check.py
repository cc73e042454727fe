"""The one-pass int8 check and norm agree with the full decode, and accept nothing it refuses."""
import math
import struct

import numpy as np
import pytest
import torch

from compression import make_codec
from compression.wire import encode_update
from coordinator.checks.adapters import check_update, checked_norm, stored_deltas
from coordinator.aggregation import l2_norm
from coordinator.checks.fused_check import int8_config, int8_update_norm
from compression.errors import CompressionError
from protocol.errors import FedMoEError

REFUSED = (FedMoEError, CompressionError)  # both are answered 4xx (coordinator/errors.py)

MANIFEST = sorted([("a.lora_A.weight", (8, 96)), ("a.lora_B.weight", (100, 8)), ("b.weight", (3, 7))])


def body(tmp_path, config=None, scale=1e-2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=g) * scale for n, s in MANIFEST}
    path = tmp_path / f"u{seed}"
    path.write_bytes(encode_update(tensors, MANIFEST, make_codec("int8", config or {}), seed=1))
    return path, tensors


@pytest.mark.parametrize("config", [{}, {"block_size": 32, "scale_dtype": "fp16"}, {"block_size": 2048}])
def test_norm_equals_the_decoded_norm(tmp_path, config):
    path, _ = body(tmp_path, config)
    generic = l2_norm(check_update(path, "int8", config, MANIFEST))
    fused = int8_update_norm(path, int8_config("int8", config), MANIFEST)
    assert fused is not None
    assert math.isclose(fused, generic, rel_tol=1e-6)


def _codes_start(path):
    """Offset of the last tensor's codes (it ends the body; 'b.weight' has 21 values, one block)."""
    return path.stat().st_size - 21


def test_code_minus_128_is_refused_as_by_the_decoder(tmp_path):
    path, _ = body(tmp_path)
    data = bytearray(path.read_bytes())
    data[_codes_start(path)] = 0x80  # -128 is outside [-127, 127]
    path.write_bytes(bytes(data))
    assert int8_update_norm(path, int8_config("int8", {}), MANIFEST) is None
    with pytest.raises(REFUSED, match="outside"):
        checked_norm(path, "int8", {}, MANIFEST)


@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0, 3e38])
def test_bad_or_overflowing_scale_is_refused(tmp_path, bad_scale):
    path, _ = body(tmp_path)
    data = bytearray(path.read_bytes())
    start = _codes_start(path) - 4  # the last tensor's single fp32 scale
    data[start:start + 4] = struct.pack("<f", bad_scale)
    data[_codes_start(path)] = 127  # with 3e38 the decoded 127 * scale overflows float32
    path.write_bytes(bytes(data))
    assert int8_update_norm(path, int8_config("int8", {}), MANIFEST) is None
    with pytest.raises(REFUSED):
        checked_norm(path, "int8", {}, MANIFEST)


def test_truncated_body_takes_the_generic_path_and_is_refused(tmp_path):
    path, _ = body(tmp_path)
    path.write_bytes(path.read_bytes()[:-1])
    assert int8_update_norm(path, int8_config("int8", {}), MANIFEST) is None
    with pytest.raises(REFUSED):
        checked_norm(path, "int8", {}, MANIFEST)


def test_other_codecs_and_bad_configs_use_the_generic_path(tmp_path):
    assert int8_config("int4", {}) is None
    assert int8_config("topk+int8", {}) is None
    assert int8_config("int8", {"block_size": 0}) is None
    path, tensors = body(tmp_path)
    with pytest.raises(REFUSED):
        checked_norm(path, "int8", {"block_size": 0}, MANIFEST)
    exact = math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors.values()))
    assert math.isclose(checked_norm(path, "int8", {}, MANIFEST), exact, rel_tol=1e-2)  # quantisation error only


def test_decoder_still_refuses_out_of_range_codes():
    codec = make_codec("int8", {})
    payload = np.float32(0.5).tobytes() + bytes([0x80, 1, 2])
    with pytest.raises(Exception, match="outside"):
        codec.decode(payload, 3)
    assert codec.decode(np.float32(0.5).tobytes() + bytes([1, 2, 0xFF]), 3).tolist() == [0.5, 1.0, -0.5]


@pytest.mark.parametrize("config", [{}, {"block_size": 48, "scale_dtype": "fp16"}])
def test_stored_int8_deltas_decode_exactly_as_the_codec(tmp_path, config):
    path, _ = body(tmp_path, config)
    fast = stored_deltas(path, "int8", config, MANIFEST)
    generic = check_update(path, "int8", config, MANIFEST)  # the codec's own decode
    assert fast.int8 is not None
    for name, shape in MANIFEST:
        assert fast[name].shape == shape and fast[name].dtype == torch.float32
        assert torch.equal(fast[name], generic[name])


def _body_with_code_minus_128(tmp_path):
    """An int8 body whose first code is -128 (0x80), which the codec never writes."""
    path, _ = body(tmp_path)
    data = bytearray(path.read_bytes())
    data[_codes_start(path)] = 0x80
    path.write_bytes(bytes(data))
    return path


def test_a_stored_body_that_is_not_clean_still_raises(tmp_path):
    path = _body_with_code_minus_128(tmp_path)
    deltas = stored_deltas(path, "int8", {}, MANIFEST)
    with pytest.raises(REFUSED, match="outside"):
        deltas["b.weight"]


def _raw(tmp_path, tensors):
    from protocol.tensors import save_file

    path = tmp_path / "raw.safetensors"
    save_file(tensors, path)
    return path


def test_raw_norm_in_one_pass_equals_the_decoded_norm(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {n: torch.randn(s, generator=g) for n, s in MANIFEST}
    path = _raw(tmp_path, tensors)
    assert math.isclose(checked_norm(path, "safetensors", {}, MANIFEST), l2_norm(tensors), rel_tol=1e-6)


def test_raw_norm_refuses_nan_and_survives_float32_overflow(tmp_path):
    tensors = {n: torch.zeros(s) for n, s in MANIFEST}
    tensors["b.weight"][0, 0] = 3e38
    tensors["b.weight"][0, 1] = 3e38  # the sum of squares overflows float32, the values are finite
    assert math.isclose(checked_norm(_raw(tmp_path, tensors), "safetensors", {}, MANIFEST), 3e38 * math.sqrt(2), rel_tol=1e-6)
    tensors["a.lora_A.weight"][1, 2] = float("nan")
    with pytest.raises(REFUSED, match="NaN or Inf"):
        checked_norm(_raw(tmp_path, tensors), "safetensors", {}, MANIFEST)


@pytest.mark.parametrize("config", [{}, {"block_size": 32, "scale_dtype": "fp16"}])
def test_whole_update_decode_is_bit_identical_to_tensor_by_tensor(tmp_path, config):
    """The one-pass decode a fedbuff step uses gives the very floats of the per-tensor decode (padding
    between tensors included: 21 and 800 values are not whole blocks)."""
    path, _ = body(tmp_path, config)
    deltas = stored_deltas(path, "int8", config, MANIFEST)
    whole = dict(deltas.decoded_items())
    assert list(whole) == [name for name, _ in MANIFEST]
    for name, shape in MANIFEST:
        assert whole[name].shape == shape
        assert torch.equal(whole[name], deltas[name])


def test_whole_update_decode_falls_back_and_refuses_what_the_decoder_refuses(tmp_path):
    path = _body_with_code_minus_128(tmp_path)
    with pytest.raises(REFUSED, match="outside"):
        dict(stored_deltas(path, "int8", {}, MANIFEST).decoded_items())


def test_fedbuff_over_stored_int8_updates_matches_tensor_major_order(tmp_path):
    """fedbuff now adds update after update (one decode pass each): the same floats as tensor-major."""
    from coordinator.aggregation import AggregationParams, Update, fedbuff
    paths = [body(tmp_path, seed=s)[0] for s in range(3)]
    params = AggregationParams(staleness_decay=0.5)
    updates = [Update(stored_deltas(p, "int8", {}, MANIFEST), num_samples=n, staleness=s)
               for p, n, s in zip(paths, (3, 5, 11), (0, 2, 1))]
    start = {name: torch.full(shape, 0.25) for name, shape in MANIFEST}
    result = fedbuff({k: v.clone() for k, v in start.items()}, updates, params)
    weights = [1.0 * (n / 19) * (1.0 / (1.0 + 0.5 * s)) for n, s in ((3, 0), (5, 2), (11, 1))]  # as fedbuff computes them
    for name, t in start.items():
        expected = t.clone()
        for w, u in zip(weights, updates):
            expected.add_(u.delta[name], alpha=w)
        assert torch.equal(result[name], expected)


def _reference_norm(path, config):
    """The one-pass norm as first written (every code cast to float at once, one einsum, a BLAS dot) and
    its per-block sums of squared codes."""
    from compression.codecs.blockwise import BlockwiseConfig
    from compression.wire import split_update
    cfg = BlockwiseConfig(**config)
    scale_dtype = np.dtype("<f4" if cfg.scale_dtype == "fp32" else "<f2")
    scales, codes = [], []
    for (_, shape), payload in zip(MANIFEST, split_update(path.read_bytes(), MANIFEST)):
        numel = math.prod(shape)
        nblocks = -(-numel // cfg.block_size)
        scales.append(np.frombuffer(payload[:nblocks * scale_dtype.itemsize], scale_dtype).astype(np.float32))
        padded = np.zeros(nblocks * cfg.block_size, dtype=np.int8)
        padded[:numel] = np.frombuffer(payload[nblocks * scale_dtype.itemsize:], np.int8)
        codes.append(padded)
    wide = np.concatenate(codes).astype(np.float32 if cfg.block_size <= 1024 else np.float64)
    wide = wide.reshape(-1, cfg.block_size)
    s64 = np.concatenate(scales).astype(np.float64)
    per_block = np.einsum("ij,ij->i", wide, wide).astype(np.float64)
    return math.sqrt(float(np.dot(s64 * s64, per_block))), per_block


@pytest.mark.parametrize("config", [{}, {"block_size": 32, "scale_dtype": "fp16"}, {"block_size": 48},
                                    {"block_size": 2048}])
def test_compiled_norm_matches_the_whole_update_formula(tmp_path, config):
    """The compiled pass (exact integer sums of squared codes per block, then scale^2 times each in float64,
    in order) gives the norm of the formula over all codes at once (summed pairwise there)."""
    path, _ = body(tmp_path, config, seed=7)
    reference, _ = _reference_norm(path, config)
    assert math.isclose(int8_update_norm(path, int8_config("int8", config), MANIFEST), reference, rel_tol=1e-13)


@pytest.mark.parametrize("where", [0, 5, 799])
def test_compiled_norm_refuses_a_code_of_minus_128_anywhere(tmp_path, where):
    path, _ = body(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) - 21 - 4 - 4 - 800 + where] = 0x80  # a code of 'a.lora_B.weight' (800 values), not the last tensor
    path.write_bytes(bytes(data))
    assert int8_update_norm(path, int8_config("int8", {}), MANIFEST) is None
    with pytest.raises(REFUSED, match="outside"):
        checked_norm(path, "int8", {}, MANIFEST)


def test_norm_of_an_empty_or_headerless_file_takes_the_generic_path(tmp_path):
    for content in (b"", b"FMC"):
        path = tmp_path / "short"
        path.write_bytes(content)
        assert int8_update_norm(path, int8_config("int8", {}), MANIFEST) is None
        with pytest.raises(REFUSED):
            checked_norm(path, "int8", {}, MANIFEST)


@pytest.mark.parametrize("chunk", [1 << 16, 64, 1])
@pytest.mark.parametrize("config", [{}, {"block_size": 48, "scale_dtype": "fp16"}])
def test_add_to_is_bit_identical_to_adding_the_decoded_tensors(tmp_path, monkeypatch, config, chunk):
    """A stored update added group by group through a small buffer (groups of one tensor, or of several)
    leaves the very floats that adding its one-pass decode left."""
    import coordinator.checks.fused_check as fused
    monkeypatch.setattr(fused, "CHUNK_VALUES", chunk)
    path, _ = body(tmp_path, config, seed=5)
    deltas = stored_deltas(path, "int8", config, MANIFEST)
    start = {name: torch.randn(shape, generator=torch.Generator().manual_seed(1)) for name, shape in MANIFEST}
    expected = {k: v.clone() for k, v in start.items()}
    for name, value in deltas.decoded_items():
        expected[name].add_(value, alpha=0.37)
    added = {k: v.clone() for k, v in start.items()}
    assert deltas.add_to(added, 0.37)
    for name in start:
        assert torch.equal(added[name], expected[name]), name


def test_add_to_adds_nothing_and_defers_when_the_body_is_not_clean(tmp_path):
    from coordinator.aggregation.base import add_delta
    path = _body_with_code_minus_128(tmp_path)
    deltas = stored_deltas(path, "int8", {}, MANIFEST)
    zeros = {name: torch.zeros(shape) for name, shape in MANIFEST}
    assert deltas.add_to(zeros, 1.0) is False
    assert all(not t.any() for t in zeros.values())  # nothing half-added
    with pytest.raises(REFUSED, match="outside"):
        add_delta(zeros, deltas, 1.0)  # the generic decode words the refusal


def test_non_finite_tensor_finds_nan_and_inf_anywhere():
    from coordinator.checks.adapters import non_finite_tensor
    for n in (1, 7, 31, 32, 33, 1000, 40_000):
        for position in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                t = torch.randn(n, dtype=torch.float32)
                t[position] = bad
                assert non_finite_tensor({"ok": torch.ones(3), "bad": t}) == "bad"
    assert non_finite_tensor({"a": torch.ones(4, 4), "empty": torch.zeros(0, 3), "d": torch.ones(2, dtype=torch.float64),
                              "h": torch.ones(2, dtype=torch.float16)}) is None
    assert non_finite_tensor({"h": torch.tensor([1.0, float("nan")], dtype=torch.float16)}) == "h"


@pytest.mark.parametrize("chunk", [1 << 16, 900, 64, 1])
def test_several_updates_added_together_are_bit_identical_to_one_after_another(tmp_path, monkeypatch, chunk):
    """fedbuff's buffer added group of tensors by group (int8 bodies of different block sizes and scale
    formats, and a plain tensor dict between them, which splits the run): every tensor gets the same
    additions in the same order, so the very floats of adding each decoded update in turn."""
    import coordinator.checks.fused_check as fused
    from coordinator.aggregation.base import add_deltas
    monkeypatch.setattr(fused, "CHUNK_VALUES", chunk)
    configs = [{}, {"block_size": 48, "scale_dtype": "fp16"}, {"block_size": 32}, {}, {"block_size": 100}]
    deltas = [stored_deltas(body(tmp_path, config, seed=10 + i)[0], "int8", config, MANIFEST)
              for i, config in enumerate(configs)]
    g = torch.Generator().manual_seed(4)
    plain = {name: torch.randn(shape, generator=g) * 1e-2 for name, shape in MANIFEST}
    weighted = [(deltas[0], 0.3), (deltas[1], 0.11), (deltas[2], 1.7), (plain, 0.5), (deltas[3], 0.25),
                (deltas[4], 0.9)]
    start = {name: torch.randn(shape, generator=g) for name, shape in MANIFEST}
    expected = {k: v.clone() for k, v in start.items()}
    for delta, alpha in weighted:
        items = delta.decoded_items() if hasattr(delta, "decoded_items") else delta.items()
        for name, value in items:
            expected[name].add_(value, alpha=alpha)
    added = {k: v.clone() for k, v in start.items()}
    add_deltas(added, weighted)
    for name in start:
        assert torch.equal(added[name], expected[name]), name


def test_updates_added_together_add_nothing_when_one_is_not_clean(tmp_path):
    from coordinator.aggregation.base import add_deltas
    from coordinator.checks.adapters import CompressedUpdate
    clean = stored_deltas(body(tmp_path, seed=3)[0], "int8", {}, MANIFEST)
    dirty = stored_deltas(_body_with_code_minus_128(tmp_path), "int8", {}, MANIFEST)
    zeros = {name: torch.zeros(shape) for name, shape in MANIFEST}
    assert CompressedUpdate.add_together(zeros, [(clean, 1.0), (dirty, 1.0)]) is False
    assert all(not t.any() for t in zeros.values())  # nothing half-added
    with pytest.raises(REFUSED, match="outside"):
        add_deltas(zeros, [(clean, 1.0), (dirty, 1.0)])  # one by one: the generic decode words the refusal
