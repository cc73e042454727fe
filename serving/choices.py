"""The routed model names: which adapters answer a request that names no expert.

- ``routed``: the one expert the router picks, or the gateway when its confidence is under the
  threshold (what ``auto`` did before soft mixtures).
- ``mixture``: the router's top-k experts at once, weighted by its probabilities (one forward, each
  row adding several LoRA deltas: serving/batched_lora.py). Uniform probabilities over every expert
  give exactly the equal-weight gateway, one dominant expert gives that expert; in between the answer
  moves smoothly instead of jumping at a threshold, so an unsure or wrong top expert costs less.
- ``auto``: the method measured best on held-out DS-1000 problems (``AUTO_METHOD``; docs/gateway.md).

Each choice is a function from (request text, what is loaded) to a Choice, chosen by name from ``CHOICES``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.router import mixture_weights
from serving.adapters import GATEWAY
from serving.routing import LocalRouter

ROUTED, MIXTURE = "routed", "mixture"
MIXTURE_TOP_K = 3
"""Experts in a mixture (three domains ship: all of them, so uniform uncertainty is the gateway)."""
AUTO_METHOD = MIXTURE
"""What ``auto`` means: the method bench/quality_gateway.py measured best among those serving runs. On smollm2-135m
(bench/results/quality_gateway.json, docs/gateway.md) the top-3 mixture had a lower held-out loss than one-expert
routing on every domain, both on the shipped domains and with the prompt's own domain left out, and a lower mean
than the gateway on the shipped domains; with a domain left out the gateway is still better (the mixture does
not yet meet the goal of beating both everywhere)."""


@dataclass(frozen=True)
class Choice:
    weights: dict[str, float]
    """Model name (an expert or "gateway") -> weight; one entry at weight 1 for a single adapter."""
    route: Mapping[str, float | dict[str, float]] = field(default_factory=dict)
    """What the response reports: confidence, routing time (ms) and, for a mixture, its weights."""


def routed(router: LocalRouter, text: str, experts: set[str]) -> Choice:
    result = router.route(text, experts)
    route = {"confidence": round(result.confidence, 4), "route_ms": round(1000 * result.seconds, 3)}
    return Choice({result.expert or GATEWAY: 1.0}, route)  # the one adapter, at weight 1


def mixture(router: LocalRouter, text: str, experts: set[str]) -> Choice:
    result = router.route(text, experts)
    weights = mixture_weights(result.probabilities, MIXTURE_TOP_K) if result.probabilities else {}
    route: dict[str, float | dict[str, float]] = {"confidence": round(result.confidence, 4),
                                                  "route_ms": round(1000 * result.seconds, 3)}
    if not weights:  # nothing to compare (no profiles, a prompt too short): the gateway answers
        return Choice({GATEWAY: 1.0}, route)
    return Choice(weights, route | {"mixture": weights})


CHOICES: dict[str, Callable[[LocalRouter, str, set[str]], Choice]] = {ROUTED: routed, MIXTURE: mixture}
