"""Strict safetensors parsing into zero-copy views, and chunked checks of stored files."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as st_save

import protocol.streaming as streaming
from protocol.errors import InvalidPayload, InvalidUpdate
from protocol.streaming import FileTensors, check_file, tensors_from_buffer
from protocol.tensors import manifest_of

TENSORS = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1, -2], dtype=torch.int64),
           "c": torch.ones(2, 2, dtype=torch.bfloat16), "empty": torch.zeros(0, 3)}


def raw(header: dict, data: bytes) -> bytearray:
    text = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text)) + text + data)


def test_buffer_tensors_equal_the_library_loader_and_are_views_into_the_buffer():
    buf = bytearray(st_save(TENSORS, metadata={"k": "v"}))
    got = tensors_from_buffer(buf)
    assert sorted(got) == sorted(TENSORS)
    for name, t in TENSORS.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    start = got["a"].data_ptr() - torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    buf[start:start + 4] = struct.pack("<f", 42.0)  # the tensor shares the buffer: no copy was made
    assert got["a"][0, 0] == 42.0


@pytest.mark.parametrize("body, message", [
    (b"\x80\x04\x95" + b"\x00" * 20, "header length"),  # a pickle
    (b"\x01\x00", "shorter than"),
    (raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 4), "cover|fill"),
    (raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 4), "does not fill"),
    (raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 8), "starts at 0, expected 4"),
    (raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\x00" * 8), "starts at 4, expected 0"),
    (raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 8), "cover 4 bytes of a 8"),
    (raw({"a": {"dtype": "OBJ", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 4), "bad header entry"),
    (raw({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\x00" * 4), "bad header entry"),
    (raw({"a": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}}, b"\x00" * 4), "bad header entry"),
    (raw({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 4), "bad header entry"),
    (bytearray(struct.pack("<Q", 2) + b"[]"), "not a JSON object"),
    (bytearray(struct.pack("<Q", 3) + b"{x}"), "not JSON"),
    (bytearray(struct.pack("<Q", 10**9) + b"{}"), "does not fit"),
])
def test_malformed_bodies_are_invalid_payloads(body, message):
    with pytest.raises(InvalidPayload, match=message):
        tensors_from_buffer(bytearray(body))


def test_misaligned_tensor_is_copied_not_refused():
    header = {"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "y": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}}
    got = tensors_from_buffer(raw(header, b"\x07" + struct.pack("<f", 1.5)))
    assert got["x"].item() == 7 and got["y"].item() == 1.5


def test_check_file_reads_in_chunks_and_finds_a_nan_in_the_last_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "CHECK_CHUNK", 64)  # 16 floats a chunk: 100 floats take 7 reads
    tensors = {"w": torch.zeros(10, 10), "v": torch.ones(3)}
    path = tmp_path / "u.safetensors"
    path.write_bytes(st_save(tensors))
    check_file(path, manifest_of(tensors))
    tensors["w"][9, 9] = float("inf")
    path.write_bytes(st_save(tensors))
    with pytest.raises(InvalidUpdate, match="'w' contains NaN or Inf"):
        check_file(path, manifest_of(tensors))


def test_check_file_compares_names_shapes_and_dtype(tmp_path):
    path = tmp_path / "u.safetensors"
    path.write_bytes(st_save({"w": torch.zeros(2, 2)}))
    with pytest.raises(InvalidUpdate, match=r"missing \['v'\]"):
        check_file(path, [("v", (2, 2))])
    with pytest.raises(InvalidUpdate, match=r"shape \[2, 2\], expected \[4\]"):
        check_file(path, [("w", (4,))])
    path.write_bytes(st_save({"w": torch.zeros(2, 2, dtype=torch.float16)}))
    with pytest.raises(InvalidUpdate, match="dtype F16, expected float32"):
        check_file(path, [("w", (2, 2))])


def test_file_tensors_read_each_tensor_on_demand(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(st_save(TENSORS))
    lazy = FileTensors(path)
    assert sorted(lazy) == sorted(TENSORS) and len(lazy) == 4
    assert torch.equal(lazy["a"], TENSORS["a"])
    with pytest.raises(KeyError):
        lazy["nope"]
