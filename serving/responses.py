"""OpenAI response objects: whole completions, stream chunks, the model list.

Which adapter answered goes in ``fedmoe`` (an extra field the OpenAI client keeps in
``model_extra`` and otherwise ignores) and in the X-FedMoE-Expert response header.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from serving.adapters import ROUTED_NAMES, LoadedAdapter
from serving.jobs import Job

EXPERT_HEADER = "X-FedMoE-Expert"
VERSION_HEADER = "X-FedMoE-Adapter-Version"
OWNER = "fedmoe"


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def answered_by(job: Job) -> dict[str, Any]:
    info = {"expert": job.adapter.model, "adapter_version": job.adapter.version, "requested": job.request.model}
    return info | ({"route": job.route} if job.route else {})


def headers(job: Job) -> dict[str, str]:
    return {EXPERT_HEADER: job.adapter.model, VERSION_HEADER: str(job.adapter.version)}


def usage(job: Job) -> dict[str, int]:
    prompt, completion = len(job.prompt_ids), len(job.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(job: Job, response_id: str, created: int, text: str) -> dict[str, Any]:
    if job.request.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": job.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish_reason}
    return {"id": response_id, "object": "chat.completion" if job.request.kind == "chat" else "text_completion",
            "created": created, "model": job.adapter.model, "choices": [choice], "usage": usage(job),
            "system_fingerprint": None, "fedmoe": answered_by(job)}


def chunk(job: Job, response_id: str, created: int, text: str | None, finish_reason: str | None,
          first: bool = False) -> dict[str, Any]:
    if job.request.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else \
            ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    body = {"id": response_id, "object": kind, "created": created, "model": job.adapter.model, "choices": [choice],
            "system_fingerprint": None, "fedmoe": answered_by(job)}
    if job.request.include_usage:
        body["usage"] = None
    return body


def usage_chunk(job: Job, response_id: str, created: int) -> dict[str, Any]:
    kind = "chat.completion.chunk" if job.request.kind == "chat" else "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": job.adapter.model, "choices": [],
            "usage": usage(job), "fedmoe": answered_by(job)}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def model_list(adapters: list[LoadedAdapter], routable: bool) -> dict[str, Any]:
    models = [model_entry(a.model, int(a.loaded_at), {"version": a.version, "rank": a.rank,
                                                      "kind": "gateway" if a.model == "gateway" else "expert"})
              for a in adapters]
    if routable:
        models += [model_entry(name, int(time.time()), {"kind": "router"}) for name in ROUTED_NAMES]
    return {"object": "list", "data": models}


def model_entry(name: str, created: int, info: dict[str, Any]) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": OWNER, "fedmoe": info}
