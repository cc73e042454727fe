"""Pulls racing with pruning: the current weights are always served, even while each push prunes the last version."""
import threading

import pytest

from tests.helpers import make_adapter, push, put_expert, random_like, update_meta


@pytest.mark.slow  # races threads for seconds
def test_pulls_during_pushes_that_prune_never_fail(make_app):
    app = make_app(keep_versions=1)
    adapter = make_adapter(layers=8, d_in=64, d_out=64)
    put_expert(app.test_client(), "e", adapter)
    statuses: list[int] = []
    done = threading.Event()

    def pull() -> None:
        client = app.test_client()
        while not done.is_set():
            statuses.append(client.get("/api/v1/experts/e/weights").status_code)

    pullers = [threading.Thread(target=pull) for _ in range(3)]
    for t in pullers:
        t.start()
    try:
        client = app.test_client()
        for i in range(40):
            assert push(client, "e", random_like(adapter, i), update_meta(base_version=0)).status_code == 202
    finally:
        done.set()
        for t in pullers:
            t.join()
    assert set(statuses) == {200}, sorted(set(statuses))  # before: 500s (blob gone) and 404s ("pruned")
