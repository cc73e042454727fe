"""A client's gateway calls: the merged gateway's description and weights, and prompt routing."""
from __future__ import annotations

from typing import Any

import requests

from protocol.client.bodies import read_body
from protocol.client.transport import Transport
from protocol.resume import can_resume, resumable_body
from protocol.streaming import tensors_from_buffer
from protocol.tensors import StateDict


class Gateway:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def info(self, fresh: bool = False) -> dict[str, Any]:
        """The newest gateway's description; ``fresh`` asks for one built from the experts as they are now
        (the coordinator builds it at once, without waiting for --gateway-interval; up to 30 s)."""
        return self.transport.json("GET", "/gateway", params={"fresh": "1"} if fresh else {})

    def weights(self, fmt: str = "safetensors") -> bytes:
        """The gateway's weights as one file's bytes (``fmt``: safetensors or npz)."""
        return self.transport.request("GET", "/gateway/weights", params={"format": fmt}).content

    def tensors(self) -> StateDict:
        """The gateway's tensors, streamed into one buffer (views into it, no further copies)."""
        params = {"format": "safetensors"}

        def get(extra: dict[str, str]) -> requests.Response:  # a drop mid-body resumes (protocol/resume.py)
            return self.transport.request("GET", "/gateway/weights", params=params, headers=extra, stream=True)

        r = get({})
        if not can_resume(r):
            return tensors_from_buffer(read_body(r, self.transport.base_url))
        return tensors_from_buffer(resumable_body(r, get, self.transport.retry.attempts, self.transport.base_url)[0])

    def route(self, prompt: str, threshold: float | None = None, expected: str | None = None) -> dict[str, Any]:
        """Which expert (or "gateway") should answer ``prompt``, with the scores; with ``expected`` (the expert
        the prompt belongs to) also the outcome: right, wrong_expert or fallback."""
        body: dict[str, Any] = {"prompt": prompt}
        if threshold is not None:
            body["threshold"] = threshold
        if expected is not None:
            body["expected"] = expected
        return self.transport.json("POST", "/route", json=body)

    def profiles(self) -> dict[str, Any]:
        """{"threshold", "profiles": {expert: protocol.profiles.profile_to_json form}} for routing locally."""
        return self.transport.json("GET", "/profiles")
