"""coordinator.errors: the one map from compression, gateway and router errors to API answers."""
from __future__ import annotations

import pytest

from compression.errors import CompressionError, PayloadError
from coordinator.errors import DOMAIN_ROOTS, HTTP_ERRORS, as_http_error
from gateway.errors import MergeError
from gateway.export import ExportError
from protocol.profiles import ProfileError
from protocol.errors import NotFound, error_from_response
from tests.helpers import make_adapter, push, put_expert, update_meta


@pytest.mark.parametrize("exc, status, code", [
    (PayloadError("truncated frame"), 400, "invalid_payload"),
    (CompressionError("unknown codec 'zip'"), 400, "bad_request"),
    (ProfileError("no profiles to combine"), 400, "bad_request"),
    (MergeError("rank 0 cannot be merged"), 409, "conflict"),
    (ExportError("not exportable"), 409, "conflict"),  # a GatewayError subclass not in the map: its root's answer
])
def test_each_domain_error_is_answered_by_the_map(make_app, exc, status, code):
    app = make_app()

    def fail():
        raise exc

    app.add_url_rule("/fail", "fail", fail)
    r = app.test_client().get("/fail")
    assert r.status_code == status
    assert r.get_json() == {"error": {"code": code, "message": str(exc)}}
    # and the client rebuilds the protocol error the map names
    assert type(error_from_response(r.status_code, r.get_json())) is type(as_http_error(exc))


def test_the_map_covers_only_domain_trees_and_passes_protocol_errors_through():
    assert all(issubclass(cls, DOMAIN_ROOTS) for cls in HTTP_ERRORS)
    already = NotFound("gone")
    assert as_http_error(already) is already
    with pytest.raises(TypeError):
        as_http_error(RuntimeError("a bug"))  # not a refusal: the app's 500 handler answers it


def test_an_undecodable_compressed_push_is_400_and_audited(client):
    put_expert(client, "e", make_adapter())
    meta = update_meta(codec="int8", worker_id="w1")
    r = push(client, "e", None, meta, body=b"FMC1" + b"\x00" * 40)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "invalid_payload"
    assert "not a valid 'int8' payload" in r.get_json()["error"]["message"]
    rejected = client.get("/api/v1/events", query_string={"kind": "update_rejected"}).get_json()["events"]
    assert [e["detail"]["status"] for e in rejected] == [400]
    assert rejected[0]["detail"]["reason"] == "invalid_payload"


def test_a_bad_codec_config_is_400_naming_the_uncompressed_alternative(client):
    put_expert(client, "e", make_adapter())
    r = push(client, "e", None, update_meta(codec="topk", codec_config={"ratio": 7}), body=b"x")
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "bad_request"
    assert "codec 'topk'" in r.get_json()["error"]["message"] and "'safetensors' for uncompressed" in r.get_json()["error"]["message"]


def test_a_profile_that_cannot_route_is_400(client):
    put_expert(client, "e", make_adapter())
    r = client.put("/api/v1/experts/e/profiles/w1", json={"version": 99})
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "bad_request"
