"""What the HTTP views call: admit a request (resolve its model, route, tokenize, check limits)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from serving.adapters import AUTO, GATEWAY, AdapterRegistry, LoadedAdapter
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
        adapter, route = self._resolve(request)
        job = Job(request, prompt_ids, adapter, time.monotonic() + self.limits.timeout, route)
        try:
            self.engine.submit(job)
        except Exception:
            self.registry.unpin(adapter)
            raise
        return job

    def _resolve(self, request: CompletionRequest) -> tuple[LoadedAdapter, dict]:
        if request.model != AUTO:
            return self.registry.pin(request.model), {}
        routed = self.router.route(request.routing_text, self.registry.experts())
        route = {"confidence": round(routed.confidence, 4), "route_ms": round(1000 * routed.seconds, 3)}
        if routed.expert is not None:
            try:
                return self.registry.pin(routed.expert), route
            except ModelNotFound:  # withdrawn between routing and pinning: the gateway answers
                pass
        return self.registry.pin(GATEWAY), route

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
