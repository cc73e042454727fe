"""Weights read into one flat buffer (coordinator/checks/flat_weights.py): the same tensors as load_file, and
stored int8 updates added a group of tensors per add_ leave the same floats as adds per tensor."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from compression import make_codec
from compression.wire import encode_update
from coordinator.checks.adapters import stored_deltas
from coordinator.aggregation.base import add_deltas
from coordinator.checks.flat_weights import contiguous_range, load_flat
from protocol.tensors import load_file, save_file

# sizes that are multiples of 64 (grouped adds) next to ones that are not (added tensor by tensor)
MANIFEST = sorted([("a.lora_A.weight", (8, 96)), ("a.lora_B.weight", (64, 8)), ("b.lora_A.weight", (2, 64)),
                   ("b.lora_B.weight", (100, 8)), ("c.weight", (3, 7)), ("d.weight", (128,))])


def weights(tmp_path, seed=0):
    g = torch.Generator().manual_seed(seed)
    path = tmp_path / f"w{seed}.safetensors"
    save_file({name: torch.randn(shape, generator=g) for name, shape in MANIFEST}, path)
    return path


def test_flat_load_gives_the_tensors_load_file_gives(tmp_path):
    path = weights(tmp_path)
    flat, plain = load_flat(path), load_file(path)
    assert flat is not None and list(flat) == list(plain)
    for name in plain:
        assert flat[name].shape == plain[name].shape and torch.equal(flat[name], plain[name])
    assert contiguous_range(list(flat.values())) is not None  # one buffer, in this order
    assert contiguous_range(list(plain.values())) is None


def _with_header(tmp_path, header: dict, data: bytes) -> object:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header, data", [
    ({"x": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),  # not float32
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),  # a gap before it
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12),  # trailing bytes
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),  # shape and size disagree
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "y": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),  # overlap
])
def test_anything_but_back_to_back_float32_is_left_to_load_file(tmp_path, header, data):
    assert load_flat(_with_header(tmp_path, header, data)) is None


def test_a_truncated_or_garbage_file_is_left_to_load_file(tmp_path):
    path = weights(tmp_path)
    (tmp_path / "cut").write_bytes(path.read_bytes()[:-4])
    (tmp_path / "junk").write_bytes(b"\xff" * 64)
    assert load_flat(tmp_path / "cut") is None and load_flat(tmp_path / "junk") is None


@pytest.mark.parametrize("config", [{}, {"block_size": 32, "scale_dtype": "fp16"}, {"block_size": 48}])
def test_grouped_adds_leave_the_floats_of_adds_per_tensor(tmp_path, config):
    """Flat weights take each update one add_ per group of neighbouring tensors (64-multiples, no padding
    between them); the result equals adding the decoded tensors one by one to separately loaded weights."""
    path = weights(tmp_path, seed=1)
    updates = []
    for seed in range(4):
        g = torch.Generator().manual_seed(100 + seed)
        body = tmp_path / f"u{seed}"
        body.write_bytes(encode_update({n: torch.randn(s, generator=g) * 1e-2 for n, s in MANIFEST}, MANIFEST,
                                       make_codec("int8", config), seed=seed))
        updates.append((stored_deltas(body, "int8", config, MANIFEST), 0.1 + 0.3 * seed))
    flat = load_flat(path)
    assert flat is not None
    add_deltas(flat, updates)
    expected = load_file(path)
    for delta, alpha in updates:
        for name, value in delta.decoded_items():
            expected[name].add_(value, alpha=alpha)
    for name in expected:
        assert torch.equal(flat[name], expected[name]), name
