"""Creating an expert through a relay: a real root and a real relay on loopback ports."""
from __future__ import annotations

import threading

from tests.helpers import FINGERPRINT, expert_spec, make_adapter, relay_sites


def test_workers_creating_an_expert_together_send_it_upstream_once(tmp_path):
    """A site's workers start together and each asks its relay to create the expert: one upload crosses the WAN."""
    with relay_sites(tmp_path) as (at_root, relay, at_relay, _):
        uploads = []
        original = relay.upstream.create_expert_from_file

        def counted(*args, **kwargs):
            uploads.append(args[0])
            return original(*args, **kwargs)

        relay.upstream.create_expert_from_file = counted
        for i in range(3):
            at_relay.workers.register(f"c{i}", "e2", {"id": "m", "fingerprint": FINGERPRINT})
        answers: list[int] = []
        start = threading.Barrier(3)

        def create() -> None:
            start.wait()
            answers.append(at_relay.experts.create("e2", make_adapter(seed=5), expert_spec())["version"])

        threads = [threading.Thread(target=create) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert uploads == ["e2"] and answers == [0, 0, 0]
        assert at_root.experts.get("e2")["version"] == 0
