"""What the HTTP views call: admit a request (resolve its model, route, tokenize, check limits)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from serving.adapters import AUTO, GATEWAY, AdapterRegistry, LoadedAdapter
from serving.choices import AUTO_METHOD, CHOICES
from serving.config import Limits
from serving.engine import GenerationEngine
from serving.errors import ContextTooLong, ModelNotFound
from serving.jobs import Job
from serving.routing import LocalRouter
from serving.schema import CompletionRequest


@dataclass
class ServingService:
    engine: GenerationEngine
    registry: AdapterRegistry
    router: LocalRouter
    limits: Limits
    base_model_id: str
    context_length: int
    """Positions the base model supports: prompt plus completion must fit."""
    federation: Any = None
    """The follower's FollowState (versions, last swap time), for /health."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def models(self) -> list[LoadedAdapter]:
        return self.registry.names()

    def admit(self, request: CompletionRequest) -> Job:
        """Check the request against the limits, pin its adapter and queue it for generation."""
        prompt_ids = self._prompt_ids(request)
        adapter, route, mixture = self._resolve(request)
        job = Job(request, prompt_ids, adapter, time.monotonic() + self.limits.timeout, route, mixture=mixture)
        try:
            self.engine.submit(job)
        except Exception:
            for pinned in job.pinned:
                self.registry.unpin(pinned)
            raise
        return job

    def _resolve(self, request: CompletionRequest) -> tuple[LoadedAdapter, dict, tuple]:
        """(adapter the response names, how it was routed, the mixture's (adapter, weight) pairs or ())."""
        method = AUTO_METHOD if request.model == AUTO else request.model
        if method not in CHOICES:
            return self.registry.pin(request.model), {}, ()
        choice = CHOICES[method](self.router, request.routing_text, self.registry.experts())
        pinned: list[tuple[LoadedAdapter, float]] = []
        try:
            for name, weight in sorted(choice.weights.items(), key=lambda kv: -kv[1]):
                pinned.append((self.registry.pin(name), weight))
        except ModelNotFound:  # withdrawn between routing and pinning: the gateway answers
            for adapter, _ in pinned:
                self.registry.unpin(adapter)
            return self.registry.pin(GATEWAY), dict(choice.route), ()
        route = {"method": method, **choice.route}
        return pinned[0][0], route, tuple(pinned) if len(pinned) > 1 else ()

    def _prompt_ids(self, request: CompletionRequest) -> list[int]:
        if request.messages is not None:
            text = self.tokenizer.apply_chat_template(list(request.messages), tokenize=False,
                                                      add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(request.prompt)["input_ids"]
        param = "messages" if request.messages is not None else "prompt"
        if len(ids) > self.limits.max_prompt_tokens:
            raise ContextTooLong(f"the prompt has {len(ids)} tokens; this server takes at most "
                                 f"{self.limits.max_prompt_tokens} (--max-prompt-tokens)", param=param)
        if len(ids) + request.max_tokens > self.context_length:
            raise ContextTooLong(f"this model's context is {self.context_length} tokens, but the prompt has "
                                 f"{len(ids)} and max_tokens is {request.max_tokens}; shorten one", param=param)
        return ids
