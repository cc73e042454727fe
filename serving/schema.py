"""OpenAI request bodies parsed into one typed request, every mistake a 400 naming the field.

Chat (`/v1/chat/completions`) and text (`/v1/completions`) requests differ only in how the prompt
is given; both become a ``CompletionRequest``. Fields the OpenAI API has and this server cannot
honour (n > 1, logprobs, tools) are refused rather than silently ignored; unknown fields are
ignored, as many OpenAI-compatible clients send extras.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from serving.config import Limits
from serving.errors import InvalidRequest

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP_SEQUENCES = 4
GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily: the limit of sampling as the temperature goes to 0 (vLLM's
``_SAMPLING_EPS`` draws the same line). Sampling divides the logits by the temperature; 1e-45, 5e-324 and 1e-300
pass the [0, 2] check but are 0 or a denormal in float32, the logits overflowed and torch.multinomial failed on NaN
probabilities: a 500 (issue 30, 4). Measured on tiny-qwen2: NaN at 1e-38 and below, the greedy tokens from 1e-30 up
to 1e-2, so the line leaves a wide margin and changes no answer."""
UNSUPPORTED = {"tools": "tool calls", "functions": "function calls", "logprobs": "logprobs",
               "top_logprobs": "logprobs", "suffix": "suffix", "best_of": "best_of"}


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked; requests batch together only with equal Sampling."""

    temperature: float = 1.0
    """0 means greedy decoding (so does anything below GREEDY_BELOW; the parser makes those 0)."""
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class CompletionRequest:
    kind: str
    """"chat" or "text" (which endpoint, hence which response shape)."""
    model: str
    """An expert name, "gateway" or "auto"."""
    messages: tuple[dict[str, str], ...] | None
    """Chat turns, roles normalised, content as plain text (chat only)."""
    prompt: str | None
    """The raw prompt (text only)."""
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with token counts."""

    @property
    def routing_text(self) -> str:
        """What the router compares with the experts' profiles: the user's words, not the template."""
        if self.prompt is not None:
            return self.prompt
        messages = self.messages or ()
        users = [m["content"] for m in messages if m["role"] == "user"]
        return users[-1] if users else messages[-1]["content"]


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidRequest("the request body is not valid JSON; send a JSON object "
                             "with Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_chat(body: dict[str, Any], limits: Limits) -> CompletionRequest:
    return _parse(body, limits, "chat", messages=_messages(body.get("messages")))


def parse_text(body: dict[str, Any], limits: Limits) -> CompletionRequest:
    return _parse(body, limits, "text", prompt=_prompt(body.get("prompt")))


def _parse(body: dict[str, Any], limits: Limits, kind: str, *, messages: tuple | None = None,
           prompt: str | None = None) -> CompletionRequest:
    _refuse_unsupported(body)
    stream = _optional(body, "stream", bool, False)
    options = _optional(body, "stream_options", dict, None) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest("stream_options.include_usage must be true or false", param="stream_options")
    return CompletionRequest(kind=kind, model=_model(body.get("model")), messages=messages, prompt=prompt,
                             max_tokens=_max_tokens(body, limits), sampling=_sampling(body), stop=_stop(body),
                             stream=stream, include_usage=include_usage)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n is not None and (type(n) is not int or n != 1):
        raise InvalidRequest(f"n must be 1 (one choice per request), got {n!r}", param="n")
    for key, what in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], 0, ""):
            raise InvalidRequest(f"{what} are not supported by this server; drop {key!r}", param=key)


def _model(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string: an expert name, 'gateway' or 'auto' "
                             "(GET /v1/models lists them)", param="model")
    return model


def _messages(messages: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array of {role, content} objects", param="messages")
    return tuple(_message(i, m) for i, m in enumerate(messages))


def _message(i: int, message: Any) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be an object with role and content", param=param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"{param}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", param=f"{param}.role")
    return {"role": CHAT_ROLES[role], "content": _content(message.get("content"), f"{param}.content")}


def _text(value: str, param: str) -> str:
    """``value`` if it is text a tokenizer can take: JSON can carry lone surrogates ("\\ud800"), UTF-8 cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{param} holds an unpaired UTF-16 surrogate; send valid Unicode text",
                             param=param) from None
    return value


def _content(content: Any, param: str) -> str:
    """A string, or an array of text parts (joined); images and audio are refused."""
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{param}[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}}; "
                                     "only text is supported", param=param)
            texts.append(part["text"])
        return _text("".join(texts), param)
    raise InvalidRequest(f"{param} must be a string or an array of text parts", param=param)


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # one prompt in an array; several would mean several choices
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("prompt must be a non-empty string (one prompt per request)", param="prompt")
    return _text(prompt, "prompt")


def _max_tokens(body: dict[str, Any], limits: Limits) -> int:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is None:
        return limits.max_tokens
    if type(value) is not int or value < 1:
        raise InvalidRequest(f"{key} must be a positive integer, got {value!r}", param=key)
    if value > limits.max_tokens:
        raise InvalidRequest(f"{key} is too large: {value}; this server generates at most {limits.max_tokens} "
                             "tokens per request (--max-tokens)", param=key, code="max_tokens_exceeded")
    return value


def _sampling(body: dict[str, Any]) -> Sampling:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise InvalidRequest("top_p must be above 0 (use temperature 0 for greedy decoding)", param="top_p")
    if temperature < GREEDY_BELOW:  # greedy: one Sampling for all of them, so that they batch together
        return Sampling(temperature=0.0, top_p=1.0)
    return Sampling(temperature=temperature, top_p=top_p)


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise InvalidRequest(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}", param=key)
    return float(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES \
            or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest(f"stop must be a non-empty string or an array of at most {MAX_STOP_SEQUENCES} "
                             "of them", param="stop")
    return tuple(_text(s, "stop") for s in stops)


def _optional(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidRequest(f"{key} must be {'true or false' if kind is bool else 'an object'}, got {value!r}",
                             param=key)
    return value
