"""The root's placement routes (coordinator/placement.py plans; docs/wan.md, "A hierarchy that forms itself").

    POST /api/v1/workers/<id>/probes   a worker's link measurements -> its assignment (the worker's own token)
    GET  /api/v1/placement             the plan: groups, each with its relay's id and URL (a read token)

A report names hosts by id: ``root``, or a relay id the root lists at ``GET /api/v1/relays``; a host the root does
not know is ignored (a relay that left), an unreachable one has ``rtt_ms: null``.
"""
from __future__ import annotations

import math
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from coordinator.placement import ROOT, Link, Placement
from coordinator.api.relays import registry
from protocol.errors import BadRequest, NotFound
from protocol.schemas import API_PREFIX, is_finite_number

bp = Blueprint("placement", __name__, url_prefix=API_PREFIX)
MAX_HOSTS = 1000


def placement() -> Placement:
    return current_app.extensions["fedmoe_placement"]


def relay_urls() -> dict[str, str]:
    """Relay id -> URL of the relays that published one (operator-started or embedded in a worker)."""
    return {r["relay_id"]: r["url"] for r in registry().tree() if r.get("url")}


def parse_links(body: Any, known: set[str]) -> dict[str, Link]:
    """The report's links to known hosts; 400 with the reason for anything malformed."""
    links = body.get("links") if isinstance(body, dict) else None
    if not isinstance(links, dict) or len(links) > MAX_HOSTS:
        raise BadRequest(f'a probe report is {{"links": {{host id: {{"rtt_ms": ..., "mbps": ...}}}}}} with at most '
                         f"{MAX_HOSTS} hosts")
    out: dict[str, Link] = {}
    for host, link in links.items():
        if not isinstance(link, dict):
            raise BadRequest(f"link to {host!r} must be an object with rtt_ms and mbps")
        rtt, mbps = link.get("rtt_ms"), link.get("mbps")
        for name, value in (("rtt_ms", rtt), ("mbps", mbps)):
            if value is not None and not (is_finite_number(value) and value >= 0):
                raise BadRequest(f"link to {host!r}: {name} must be a number >= 0 or null, got {value!r}")
        if host in known:
            out[host] = Link(math.inf if rtt is None else float(rtt), float(mbps or 0.0))
    if ROOT not in out:
        raise BadRequest('a probe report must measure the root (host id "root")')
    return out


@bp.post("/workers/<worker_id>/probes")
def report_probes(worker_id: str) -> Response:
    if not any(w["worker_id"] == worker_id for w in current_app.extensions["fedmoe"].list_workers()):
        raise NotFound(f"no worker {worker_id!r} registered here: register first (POST /api/v1/workers)")
    relays = relay_urls()
    links = parse_links(request.get_json(silent=True), {ROOT, *relays})
    changed = placement().report(worker_id, links, sorted(relays))
    if changed:
        current_app.logger.info("placement: plan %d: %s", placement().generation, placement().view()["groups"])
    return jsonify(placement().assignment(worker_id))


@bp.get("/placement")
def placement_view() -> Response:
    view, urls = placement().view(), relay_urls()
    for group in view["groups"]:
        group["relay_url"] = urls.get(group["relay_id"]) if group["relay_id"] else None
    return jsonify(view)


def init_app(app: Flask) -> None:
    app.extensions["fedmoe_placement"] = Placement()
    app.register_blueprint(bp)
