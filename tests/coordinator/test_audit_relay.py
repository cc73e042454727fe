"""Audit finding in the relay's API (coordinator/relay/api.py; engineer wan's file): expert names from the path go
into the upstream URL unchecked.

Sent: ``GET /api/v1/experts/e1%3Fx=1/weights`` to a relay with its admin token (the name decodes to ``e1?x=1``).
Came back: 200 ``application/octet-stream`` whose body is the root's JSON expert info: the relay asked upstream for
``/experts/e1?x=1/weights`` (= ``GET /experts/e1``, a query after it) with its own relay token, and its weights
cache then held that JSON as the weights of an expert named ``e1?x=1``. The same holds for ``?since=`` diffs (passed
upstream as they came; ``PUT .../profiles/<worker_id>`` happened to answer 400). Worker tokens cannot reach it (their
specialty must equal the name and is checked at registration), so only the relay's admin can, but nothing that
is not a weights file should enter the cache. Fixed: ``check_name`` on ``name`` (and ``worker_id``) in the relay's
``expert_weights`` (which serves ``?since=`` diffs itself since then) and ``put_profile``.
"""
from __future__ import annotations

import pytest

from tests.coordinator.test_relay_app import relay, root  # noqa: F401 - fixtures


@pytest.mark.parametrize("path", ["/api/v1/experts/e1%3Fx=1/weights",
                                  "/api/v1/experts/e1%3Fx=1/weights?since=0"])
def test_an_expert_name_with_a_query_is_refused_by_the_relay(relay, path):  # noqa: F811 - the fixture
    app, _ = relay
    admin = app.test_client(token=app.extensions["fedmoe_auth"].admin_token)
    answer = admin.get(path)

    assert answer.status_code == 400, answer.data[:200]
    assert answer.json["error"]["code"] == "bad_request"
