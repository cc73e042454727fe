"""The compiled int8 paths (coordinator/checks/int8_kernel.py) against the per-tensor ones, on real encoded bodies."""
import math

import numpy as np
import pytest
import torch

from bench.shapes import lora_manifest
from compression import make_codec
from compression.wire import decode_update, encode_update, index_update_file, split_update
from coordinator.checks import int8_kernel
from coordinator.checks.adapters import check_update, checked_norm, non_finite_tensor, stored_deltas
from coordinator.aggregation import AggregationParams, Update, fedbuff, l2_norm
from coordinator.checks.flat_weights import flat_offsets, load_flat
from coordinator.checks.fused_check import int8_config, int8_update_norm
from protocol.errors import FedMoEError
from protocol.tensors import save_file

# Odd shapes (sizes that are no multiple of a block or of a vector), an empty tensor, one value, and a tensor
# of more than 65,536 values (the norm's integer sums are split there), beside real LoRA shapes.
ODD = sorted([("a.lora_A.weight", (8, 96)), ("a.lora_B.weight", (100, 8)), ("b.weight", (3, 7)),
              ("c.bias", (1,)), ("d.empty", (0, 5)), ("e.big", (70_001,))])
LORA = lora_manifest("tiny-qwen2", 8)
CONFIGS = [{}, {"block_size": 48, "scale_dtype": "fp16"}, {"block_size": 32}, {"block_size": 1},
           {"block_size": 100_000}]


def tensors(manifest, seed, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * scale for name, shape in manifest}


def encoded(tmp_path, manifest, config, seed):
    path = tmp_path / f"u{seed}"
    path.write_bytes(encode_update(tensors(manifest, seed), manifest, make_codec("int8", config), seed=seed))
    return path


def flat_weights(tmp_path, manifest, seed=99):
    """Weights as a step holds them: read by load_flat into one buffer, each tensor a view of it."""
    path = tmp_path / f"w{seed}.safetensors"
    save_file(tensors(manifest, seed, 0.1), path)
    weights = load_flat(path)
    assert weights is not None and flat_offsets([weights[n] for n, _ in manifest]) is not None
    return weights


def _exact_norm(path, manifest, cfg):
    """sqrt(sum over blocks of scale^2 * sum of code^2), from the bytes with numpy, tensor by tensor."""
    total = 0.0
    scale_dtype = np.dtype("<f2" if cfg.scale_dtype == "fp16" else "<f4")
    for (_, shape), payload in zip(manifest, split_update(path.read_bytes(), manifest)):
        numel, block = math.prod(shape), cfg.block_size
        nblocks = -(-numel // block)
        scales = np.frombuffer(payload[:nblocks * scale_dtype.itemsize], scale_dtype).astype(np.float64)
        codes = np.zeros(nblocks * block, dtype=np.int64)
        codes[:numel] = np.frombuffer(payload[nblocks * scale_dtype.itemsize:], np.int8)
        total += math.fsum(scales ** 2 * (codes.reshape(nblocks, block) ** 2).sum(axis=1))
    return math.sqrt(total)


@pytest.mark.parametrize("manifest", [ODD, LORA], ids=["odd", "lora"])
@pytest.mark.parametrize("config", CONFIGS)
def test_layout_and_norm_match_the_per_tensor_decode(tmp_path, manifest, config):
    path = encoded(tmp_path, manifest, config, seed=3)
    cfg = int8_config("int8", config)
    lay = int8_kernel.layout(manifest, cfg)
    with open(path, "rb") as f:
        assert lay.spans() == index_update_file(f, path.stat().st_size, manifest)
    assert lay.size == path.stat().st_size
    decoded = decode_update(path.read_bytes(), manifest, make_codec("int8", config))  # the codec, tensor by tensor
    rounded = math.sqrt(math.fsum(float((t.double() ** 2).sum()) for t in decoded.values()))
    norm = int8_update_norm(path, cfg, manifest)
    assert norm is not None and math.isclose(norm, _exact_norm(path, manifest, cfg), rel_tol=1e-13)
    assert math.isclose(norm, rounded, rel_tol=1e-7)  # the decoded values are code * scale rounded to float32
    generic = l2_norm(check_update(path, "int8", config, manifest))  # float32 sums over a tensor: ~1e-6 off
    assert math.isclose(checked_norm(path, "int8", config, manifest), generic, rel_tol=1e-5)


@pytest.mark.parametrize("manifest", [ODD, LORA], ids=["odd", "lora"])
@pytest.mark.parametrize("group", [int8_kernel.GROUP_VALUES, 1000, 1])
def test_flat_step_is_bit_identical_to_adding_decoded_tensors(tmp_path, monkeypatch, manifest, group):
    """K stored updates of mixed block sizes and scale formats added to flat weights in one compiled pass per
    body (groups of one tensor, a few, or many) leave the floats of decoding each tensor with the codec and
    ``add_`` ing it, update after update."""
    monkeypatch.setattr(int8_kernel, "GROUP_VALUES", group)
    configs = CONFIGS + [{}]
    paths = [encoded(tmp_path, manifest, config, seed=10 + i) for i, config in enumerate(configs)]
    alphas = [0.3, 0.11, 1.7, 0.25, 0.9, 1 / 3]
    weights = flat_weights(tmp_path, manifest)
    expected = {k: v.clone() for k, v in weights.items()}
    for path, config, alpha in zip(paths, configs, alphas):
        for name, value in decode_update(path.read_bytes(), manifest, make_codec("int8", config)).items():
            expected[name].add_(value, alpha=alpha)
    deltas = [stored_deltas(p, "int8", c, manifest) for p, c in zip(paths, configs)]
    from coordinator.aggregation.base import add_deltas
    add_deltas(weights, list(zip(deltas, alphas)))
    for name, _ in manifest:
        assert torch.equal(weights[name], expected[name]), name


def test_fedbuff_on_flat_weights_equals_fedbuff_on_separate_tensors(tmp_path):
    """The compiled path (flat weights) and the numpy one (a dict of separate tensors) give the same step."""
    paths = [encoded(tmp_path, LORA, {}, seed=s) for s in range(4)]
    params = AggregationParams(staleness_decay=0.5, server_lr=1.3)
    updates = [Update(stored_deltas(p, "int8", {}, LORA), num_samples=n, staleness=s)
               for p, n, s in zip(paths, (3, 5, 11, 2), (0, 2, 1, 0))]
    flat = flat_weights(tmp_path, LORA)
    separate = {k: v.clone() for k, v in flat.items()}
    assert flat_offsets(list(separate.values())) is None
    fedbuff(flat, updates, params)
    fedbuff(separate, updates, params)
    for name, _ in LORA:
        assert torch.equal(flat[name], separate[name]), name


def _spoil(path, how):
    data = bytearray(path.read_bytes())
    lay = int8_kernel.layout(ODD, int8_config("int8", {}))
    t = [n for n, _ in ODD].index("a.lora_B.weight")
    if how == "code":
        data[int(lay.codes_at[t]) + 17] = 0x80  # -128: outside [-127, 127]
    elif how == "nan_scale":
        data[int(lay.scales_at[t]):int(lay.scales_at[t]) + 4] = np.float32("nan").tobytes()
    elif how == "negative_scale":
        data[int(lay.scales_at[t]):int(lay.scales_at[t]) + 4] = np.float32(-1).tobytes()
    elif how == "huge_scale":
        data[int(lay.scales_at[t]):int(lay.scales_at[t]) + 4] = np.float32(3e38).tobytes()
    elif how == "length":
        data[int(lay.length_at[t])] ^= 1
    elif how == "magic":
        data[0] = ord("X")
    elif how == "truncated":
        del data[-1]
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["code", "nan_scale", "negative_scale", "huge_scale", "length", "magic", "truncated"])
def test_a_body_that_is_not_clean_is_neither_measured_nor_added(tmp_path, how):
    bad = _spoil(encoded(tmp_path, ODD, {}, seed=1), how)
    cfg = int8_config("int8", {})
    assert int8_update_norm(bad, cfg, ODD) is None  # the generic path then answers
    if how != "huge_scale":  # decodes (to values that overflow float32): the step's finiteness check refuses it
        with pytest.raises((FedMoEError, Exception)):
            checked_norm(bad, "int8", {}, ODD)
    clean = encoded(tmp_path, ODD, {}, seed=2)
    weights = flat_weights(tmp_path, ODD)
    before = {k: v.clone() for k, v in weights.items()}
    flat, at = flat_offsets([weights[n] for n, _ in ODD])
    lay = int8_kernel.layout(ODD, cfg)
    bodies = [(memoryview(clean.read_bytes()), lay, 1.0), (memoryview(bad.read_bytes()), lay, 1.0)]
    assert int8_kernel.add_updates(flat, at, bodies) is False
    assert all(torch.equal(weights[n], before[n]) for n, _ in ODD)  # nothing half-added


def test_other_codecs_do_not_frame_as_int8(tmp_path):
    for codec in ("int4", "topk+int8"):
        path = tmp_path / codec
        path.write_bytes(encode_update(tensors(ODD, 0), ODD, make_codec(codec, {})))
        assert int8_update_norm(path, int8_config("int8", {}), ODD) is None
        assert int8_config(codec, {}) is None
        assert checked_norm(path, codec, {}, ODD) == pytest.approx(l2_norm(check_update(path, codec, {}, ODD)))


def test_non_finite_tensor_on_flat_weights(tmp_path):
    weights = flat_weights(tmp_path, ODD)
    assert non_finite_tensor(weights) is None
    weights["e.big"][69_999] = float("inf")
    assert non_finite_tensor(weights) == "e.big"
    weights["e.big"][69_999] = 0.0
    weights["b.weight"][2, 6] = float("nan")
    assert non_finite_tensor(weights) == "b.weight"


@pytest.mark.parametrize("manifest", [ODD, LORA], ids=["odd", "lora"])
def test_save_flat_writes_the_bytes_of_save_file(tmp_path, manifest):
    from coordinator.checks.flat_weights import save_flat
    weights = flat_weights(tmp_path, manifest)
    weights[manifest[0][0]].add_(1.5)
    save_file(weights, tmp_path / "reference")
    assert save_flat(weights, tmp_path / "flat")
    assert (tmp_path / "flat").read_bytes() == (tmp_path / "reference").read_bytes()
    separate = {k: v.clone() for k, v in weights.items()}
    assert not save_flat(separate, tmp_path / "not_flat") and not (tmp_path / "not_flat").exists()
    quoted = dict(weights)
    quoted['a"b'] = quoted.pop(manifest[0][0])
    assert not save_flat(quoted, tmp_path / "escaped")  # a name JSON would escape: left to safetensors
