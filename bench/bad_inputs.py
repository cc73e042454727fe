"""The bad-input matrix: every case one bad request and the 4xx it must get, with a JSON error.

tests/e2e/test_bad_inputs.py sends it to a coordinator of its own and checks every answer; bench.hostile sends it
under a memory watch (its ``bad_inputs`` attack). Expert ``e`` (and ``other``) exist and ``e`` is at version 1 after
``FIRST_BODY`` was pushed with ``REPLAYED``; the coordinator runs with ``SERVER_FLAGS``.
"""
from __future__ import annotations

import http.client
import io
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests
import torch

from bench.common import recorded_token
from bench.updates import expert_spec, make_adapter, random_like, update_meta
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps

SERVER_FLAGS = ("--max-body-mb", "1", "--norm-check", "reject", "--norm-warmup", "1", "--norm-factor", "10")
"""The coordinator's flags the cases assume: small bodies (the oversized cases stay cheap), outsized updates refused."""
ADAPTER = make_adapter()
LIMIT = 1 << 20  # --max-body-mb 1
REPLAYED = update_meta(num_samples=3) | {"update_id": "replayed-1"}
FIRST_BODY = dumps(random_like(ADAPTER, 1))


@dataclass
class Server:
    """A coordinator started with the flags the matrix assumes (--max-body-mb 1, --norm-check reject)."""

    url: str
    join_token: str = ""

    @property
    def auth(self) -> dict[str, str]:
        """The admin token the coordinator recorded for clients on this machine."""
        return {"Authorization": f"Bearer {recorded_token(self.url)}"}

    def push(self, body: bytes, meta: dict | None = None, expert: str = "e", **headers: str) -> requests.Response:
        meta_header = json.dumps(meta or update_meta())
        return requests.post(f"{self.url}/api/v1/experts/{expert}/updates", data=body,
                             headers={**self.auth, UPDATE_HEADER: meta_header, **headers}, timeout=60)

    def put_expert(self, name: str, body: bytes, spec: dict | str) -> requests.Response:
        header = spec if isinstance(spec, str) else json.dumps(spec)
        return requests.put(f"{self.url}/api/v1/experts/{name}", data=body,
                            headers={**self.auth, EXPERT_HEADER: header}, timeout=60)

    def get(self, path: str) -> requests.Response:
        return requests.get(f"{self.url}/api/v1{path}", headers=self.auth, timeout=30)

    def worker_token(self, worker_id: str, specialty: str) -> str:
        """Register a worker with the join token, as a remote worker would; its scoped token."""
        r = requests.post(f"{self.url}/api/v1/workers", json={"worker_id": worker_id, "specialty": specialty,
                                                              "base_model": expert_spec()["base_model"]},
                          headers={"Authorization": f"Bearer {self.join_token}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["token"]


def delta(**changes: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A random delta shaped like ADAPTER; a tensor in ``changes`` replaces or adds one, None drops one."""
    tensors: dict[str, torch.Tensor | None] = {**random_like(ADAPTER, 2), **changes}
    return {k: v for k, v in tensors.items() if v is not None}


FIRST = sorted(ADAPTER)[0]


def first_as(fill: float | None = None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A delta whose first tensor is replaced: filled with ``fill`` (zeros by default) in ``dtype``."""
    shape = ADAPTER[FIRST].shape
    return delta(**{FIRST: torch.zeros(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)})


def raw_post(s: "Server", headers: dict[str, str]) -> requests.Response:
    return requests.post(f"{s.url}/api/v1/experts/e/updates", data=FIRST_BODY, headers={**s.auth, **headers},
                         timeout=60)


def pickled(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)  # what a careless client would send: must never be unpickled
    return buffer.getvalue()


def lying_header() -> bytes:
    body = dumps(delta())
    return struct.pack("<Q", 1 << 40) + body[8:]  # header length far past the end of the body


def post_chunked(url: str, path: str, headers: dict[str, str], total: int, chunk: int = 64 << 10) -> tuple[int, bytes]:
    """POST ``total`` bytes with Transfer-Encoding: chunked (no Content-Length); (status, body).

    The server may answer 413 and close before the whole body is sent: stop sending then, read the answer.
    """
    parts = urlsplit(url)
    assert parts.hostname, f"no host in {url!r}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest("POST", path)
        for key, value in {**headers, "Transfer-Encoding": "chunked"}.items():
            conn.putheader(key, value)
        conn.endheaders()
        try:
            for _ in range(total // chunk):
                conn.send(b"%x\r\n" % chunk + b"\0" * chunk + b"\r\n")
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def with_metadata(body: bytes, metadata: object) -> bytes:
    """The same safetensors file with its ``__metadata__`` replaced (the header re-padded to 8 bytes)."""
    (length,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8:8 + length]) | {"__metadata__": metadata}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body[8 + length:]


DEEP = "[" * 3000 + "]" * 3000  # Python's JSON parser recursed per level: a RecursionError, a 500


def full_spec(num_parameters: int) -> dict:
    return {"kind": "full", "full": {"num_parameters": num_parameters}, "base_model": expert_spec()["base_model"]}


def post_json(s: "Server", path: str, body: str | bytes, method: str = "post") -> requests.Response:
    return requests.request(method, f"{s.url}/api/v1{path}", data=body,
                            headers={**s.auth, "Content-Type": "application/json"}, timeout=60)


def overflowing_push(s: "Server") -> requests.Response:
    """Two finite pushes of 3e38: the second would make the stored expert +Inf (float32)."""
    assert s.put_expert("big", dumps(ADAPTER), expert_spec()).status_code == 201
    huge = dumps({k: torch.full_like(v, 3e38) for k, v in ADAPTER.items()})
    assert s.push(huge, update_meta(base_version=0), expert="big").status_code == 202
    return s.push(huge, update_meta(base_version=1), expert="big")


Case = Callable[[Server], "requests.Response | tuple[int, bytes]"]

CASES: list[tuple[str, Case, int]] = [
    # bodies that are not safetensors
    ("pickle update", lambda s: s.push(pickled(delta())), 400),
    ("pickle adapter", lambda s: s.put_expert("pickled", pickled(ADAPTER), expert_spec()), 400),
    ("garbage body", lambda s: s.push(b"\x00not a tensor file" * 50), 400),
    ("empty body", lambda s: s.push(b""), 400),
    ("truncated safetensors", lambda s: s.push(dumps(delta())[:-17]), 400),
    ("header length lies", lambda s: s.push(lying_header()), 400),
    ("header not JSON", lambda s: s.push(b"\x10" + b"\0" * 7 + b"{not json!!!!!!}"), 400),
    ("garbage compressed payload", lambda s: s.push(b"FMC1" + b"\xff" * 64, update_meta(codec="int8")), 400),
    ("truncated compressed payload", lambda s: s.push(b"FMC1\x01", update_meta(codec="topk+int8")), 400),
    ("unknown codec", lambda s: s.push(dumps(delta()), update_meta(codec="zip")), 400),
    ("codec_config for safetensors", lambda s: s.push(dumps(delta()), update_meta(codec_config={"x": 1})), 400),
    # tensors that parse but do not fit the expert
    ("unknown tensor name", lambda s: s.push(dumps(delta(**{"evil.weight": torch.zeros(2, 2)}))), 422),
    ("missing tensor", lambda s: s.push(dumps(delta(**{FIRST: None}))), 422),
    ("wrong shape", lambda s: s.push(dumps(delta(**{FIRST: torch.zeros(3, 3)}))), 422),
    ("float16 dtype", lambda s: s.push(dumps(first_as(dtype=torch.float16))), 422),
    ("int64 dtype", lambda s: s.push(dumps(first_as(dtype=torch.int64))), 422),
    ("NaN", lambda s: s.push(dumps(first_as(float("nan")))), 422),
    ("Inf", lambda s: s.push(dumps(first_as(float("-inf")))), 422),
    ("adapter of the wrong rank", lambda s: s.put_expert("r3", dumps(ADAPTER), expert_spec(rank=3)), 422),
    ("adapter with NaN", lambda s: s.put_expert("nan", dumps(first_as(float("nan"))), expert_spec()), 422),
    # headers the safetensors loader refuses: checked with its rules before anything is stored
    ("full expert with non-string __metadata__",
     lambda s: s.put_expert("fullbad", with_metadata(dumps({"w": torch.ones(3)}), {"x": 1}), full_spec(3)), 400),
    ("update with non-string __metadata__", lambda s: s.push(with_metadata(dumps(delta()), {"x": [1]})), 400),
    # results that would overflow float32
    ("update whose result overflows", overflowing_push, 422),
    # metadata
    ("missing update header", lambda s: raw_post(s, {}), 400),
    ("update header not JSON", lambda s: raw_post(s, {UPDATE_HEADER: "{"}), 400),
    ("negative num_samples", lambda s: s.push(dumps(delta()), update_meta(num_samples=-1)), 400),
    ("num_samples past 64 bits", lambda s: s.push(dumps(delta()), update_meta(num_samples=2**70)), 400),
    ("bad update_id", lambda s: s.push(dumps(delta()), update_meta() | {"update_id": "../../etc/passwd"}), 400),
    ("expert spec not JSON", lambda s: s.put_expert("x", dumps(ADAPTER), "[1,"), 400),
    ("bad expert name", lambda s: s.put_expert("-bad name", dumps(ADAPTER), expert_spec()), 400),
    ("unknown expert", lambda s: s.push(dumps(delta()), expert="nobody"), 404),
    ("expert name ending in a newline", lambda s: s.put_expert("x%0A", dumps(ADAPTER), expert_spec()), 400),
    ("update_id ending in a newline",
     lambda s: s.push(dumps(delta()), update_meta() | {"update_id": "u-1\n"}), 400),
    # JSON nested 3,000 deep, on every route and header that parses JSON
    ("deep JSON on /route", lambda s: post_json(s, "/route", DEEP), 400),
    ("deep JSON on /workers", lambda s: post_json(s, "/workers", DEEP), 400),
    ("deep JSON profile", lambda s: post_json(s, "/experts/e/profiles/w", DEEP, "put"), 400),
    ("deep JSON in the update header", lambda s: raw_post(s, {UPDATE_HEADER: DEEP}), 400),
    ("deep JSON in the expert header", lambda s: s.put_expert("deep", dumps(ADAPTER), DEEP), 400),
    ("deep JSON codec_config", lambda s: s.get("/experts/e/weights?since=0&codec=fp16&codec_config="
                                              + "[" * 100 + "]" * 100), 400),
    ("deep JSON object on /route", lambda s: post_json(s, "/route", '{"a":' * 40 + "1" + "}" * 40), 400),
    # stored state
    ("replayed update_id, different body", lambda s: s.push(dumps(delta()), REPLAYED), 409),
    ("replayed update_id, other expert", lambda s: s.push(FIRST_BODY, REPLAYED, expert="other"), 409),
    ("base_version ahead", lambda s: s.push(dumps(delta()), update_meta(base_version=99)), 409),
    ("expert exists with other rank",
     lambda s: s.put_expert("e", dumps(make_adapter(rank=3)), expert_spec(rank=3)), 409),
    # size
    ("oversized body", lambda s: s.push(b"\0" * (LIMIT + 1)), 413),
    ("prompt over 64 KiB", lambda s: post_json(s, "/route", json.dumps({"prompt": "x" * (64 << 10)})), 413),
    ("chunked prompt over 64 KiB", lambda s: post_chunked(s.url, "/api/v1/route",
                                                          {**s.auth, "Content-Type": "application/json"},
                                                          128 << 10), 413),
    ("registration over 1 MiB", lambda s: post_json(s, "/workers", json.dumps({"pad": "x" * (1 << 20)})), 413),
    ("oversized chunked body", lambda s: post_chunked(s.url, "/api/v1/experts/e/updates",
                                                      {**s.auth, UPDATE_HEADER: json.dumps(update_meta())},
                                                      4 * LIMIT), 413),
    # robustness: far above the expert's accepted norms (--norm-check reject)
    ("huge norm", lambda s: s.push(dumps({k: 1000 * v for k, v in delta().items()})), 422),
    # credentials
    ("no token", lambda s: s.push(FIRST_BODY, Authorization=""), 401),
    ("bad token", lambda s: s.push(FIRST_BODY, Authorization="Bearer fmwrk_not-a-token"), 401),
    ("join token pushing", lambda s: s.push(FIRST_BODY, Authorization=f"Bearer {s.join_token}"), 403),
    ("token of another specialty",
     lambda s: s.push(FIRST_BODY, update_meta(worker_id="w-other"),
                      Authorization=f"Bearer {s.worker_token('w-other', 'other')}"), 403),
]
