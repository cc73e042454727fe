"""A relay never acknowledges what it cannot forward, and a batch the root refuses never takes honest updates with it.

The attack (issue 30, item 1): behind a relay, one worker pushes finite deltas of 3e38 with a large num_samples. The
relay answered 202 (it checked only that the update itself was finite); the batch carrying the second one overflowed
at the root, which answered 422, and the relay dropped the whole batch with every member: 6 of 9 honest updates that
had their 202 were never applied. With --site-model, workers pulled weights holding Inf. Real roots and relays on
loopback ports (tests.helpers.relay_sites, tests.coordinator.test_relay_exactly_once).
"""
from __future__ import annotations

import threading

import pytest
import torch

from coordinator.storage.blobs import BlobStore
from coordinator.checks.norm_check import NormPolicy
from coordinator.relay.checks import RelayChecks
from coordinator.relay.relay_store import RelayStore
from coordinator.relay.relay_store_schema import Batch
from coordinator.checks.update_limits import UpdateLimits
from protocol.errors import InvalidUpdate
from protocol.tensors import dumps, loads
from tests.coordinator.test_relay_exactly_once import make_relay, push, root, root_weights, token_at  # noqa: F401
from tests.helpers import FINGERPRINT, make_adapter, random_like, relay_fetches, relay_sites

BASE = {"id": "m", "fingerprint": FINGERPRINT}
HONEST = ("h1", "h2", "h3")


def poison(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Finite, and twice it is not (float32's largest value is 3.4e38)."""
    return {k: torch.full_like(v, 3e38) for k, v in adapter.items()}


def send(client, worker: str, update_id: str, delta, samples: int) -> str:
    client.updates.push("e1", dumps(delta), {"update_id": update_id, "base_version": 0, "num_samples": samples,
                                            "worker_id": worker})
    return update_id


def finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


@pytest.mark.parametrize("site_model", [False, True], ids=["plain", "site_model"])
def test_a_poisoning_worker_costs_no_honest_update_and_no_pull_holds_inf(tmp_path, site_model):
    # the site model at --async-alpha 1 (each update whole): at the default 1 / N, five workers' poisoned deltas
    # weigh 1/5 each and three of them never overflow, so the checks below would not be reached
    with relay_sites(tmp_path, site_model=site_model, relay_coordinator={"async_alpha": 1.0}) as (
            at_root, relay, at_relay, _):
        for worker in ("evil", *HONEST):
            at_relay.workers.register(worker, "e1", BASE)
        relay_fetches(relay)  # version 0, frozen: the relay learns of the root's next versions late, as over a WAN
        adapter = make_adapter()
        acked, evil, pulls = [], [], []
        for round_ in range(3):
            acked += [send(at_relay, w, f"{w}-{round_}", random_like(adapter, 10 * round_ + i), 10)
                      for i, w in enumerate(HONEST)]
            try:
                evil.append(send(at_relay, "evil", f"evil-{round_}", poison(adapter), 10 ** 6))
            except InvalidUpdate as exc:
                evil.append(exc.details["reason"])
            relay.forwarder.flush()
            pulls.append(at_relay.experts.pull("e1", worker_id="h1").tensors)
            if round_ == 1:
                relay_fetches(relay)  # the relay now holds the version the first poisoned batch made

        assert [at_root.updates.status(u)["status"] for u in acked] == ["applied"] * 9
        assert [relay.update_status(u)["status"] for u in acked] == ["forwarded"] * 9
        assert all(finite(p) for p in pulls) and finite(at_root.experts.pull("e1", worker_id="w-root").tensors)
        # the first poisoned update is one the root takes (its sum with the weights is finite): applied. The
        # second: a plain relay cannot know yet that the root's weights are 3e38 (its cache is a version behind),
        # acknowledges it, and the root refuses the batch carrying it, which is split until it is alone; a site
        # model owes the first batch until the root's version with it arrives, so the sum is refused before the
        # 202. The third is refused before the 202 by both, from the version they hold.
        assert evil == (["evil-0", "evil-1", "result_not_finite"] if not site_model else
                        ["evil-0", "result_not_finite", "result_not_finite"])
        assert at_root.updates.status("evil-0")["status"] == "applied"
        refusals = {e["update_id"]: e for e in relay.events(50, kind="update_rejected")}
        assert set(refusals) == ({"evil-1", "evil-2"})
        assert all(e["worker_id"] == "evil" and e["detail"]["reason"] == "result_not_finite"
                   for e in refusals.values())
        if not site_model:
            assert relay.update_status("evil-1")["status"] == "refused" and refusals["evil-1"]["detail"]["upstream"]
        assert relay.store.queued_bytes() == 0 and set(relay.blobs.digests()) == relay.store.referenced_blobs()


@pytest.mark.parametrize("refused_by", ["root", "relay"])
def test_a_refused_batch_is_bisected_and_the_residual_owes_exactly_the_honest_updates(root, tmp_path,  # noqa: F811
                                                                                   refused_by):
    """Error feedback (top-k, 20%): what the root applied plus the relay's residual is every honest delta, exactly;
    the refused update's share is in neither. The relay refuses the batch itself (without uploading it) when its
    cache already holds the root's new weights, else the root does."""
    root_app, _, admin, join = root
    relay = make_relay(root, tmp_path, "r1", codec="topk", codec_config={"ratio": 0.2})
    service = relay.extensions["fedmoe"]
    try:
        adapter = make_adapter()
        service.cache.get("e1", wait=True)
        service.cache.revalidate_seconds = 1e9  # the relay holds version 0 until told
        spike = {k: torch.zeros_like(v) for k, v in adapter.items()}
        first = next(iter(spike))
        spike[first][0, 0] = 3e38  # one value the root's weights then hold: the same again overflows
        assert push(root_app, token_at(root_app, join, "wa"), spike, "S", 1, "wa").status_code == 202
        w1 = root_weights(admin)
        d1, d2 = random_like(adapter, 1), random_like(adapter, 2)
        bad = random_like(adapter, 3, scale=1.0)
        bad[first][0, 0] = 3e38
        token = token_at(relay, join, "wa")
        for update_id, delta, samples in (("U1", d1, 4), ("BAD", bad, 10 ** 6), ("U2", d2, 4)):
            assert push(relay, token, delta, update_id, samples, "wa").status_code == 202  # a version-0 view
        if refused_by == "relay":
            service.cache.revalidate_seconds = 0.0
            service.cache.get("e1", wait=True)  # version 1, with the spike
        last_event = max((e["id"] for e in root_app.extensions["fedmoe"].events(1)), default=0)

        # {U1, BAD, U2} refused -> {U1, BAD} refused, {U2} sent -> {U1} sent, {BAD} refused: all in one cycle
        assert service.forwarder.forward_once() == 2
        answers = [service.update_status(u) for u in ("U2", "U1", "BAD")]  # batches 1 and 2 were split
        assert [(a["status"], a["forwarded_as"].rsplit(".", 1)[1]) for a in answers] == [
            ("forwarded", "3"), ("forwarded", "4"), ("refused", "5")]
        refused_upstream = root_app.extensions["fedmoe"].events(50, after=last_event, kind="update_rejected")
        assert len(refused_upstream) == (3 if refused_by == "root" else 0)  # the relay's own refusals cost no upload
        got = root_weights(admin)
        residual = loads(service.blobs.path(service.store.residual("e1")).read_bytes())
        for k in w1:
            owed = got[k] - w1[k] + residual[k]  # fedasync, lr 1, no staleness decay: the root adds each batch
            keep = torch.ones_like(owed, dtype=torch.bool)
            if k == first:
                keep[0, 0] = False  # 3e38 + a small step is 3e38 in float32: nothing to compare there
            assert torch.allclose(owed[keep], (d1[k] + d2[k])[keep], atol=1e-5), k
        assert admin.experts.get("e1")["samples_seen"] == 1 + 4 + 4
        assert set(service.blobs.digests()) == service.store.referenced_blobs()
    finally:
        service.close()


def test_a_batch_refused_by_a_request_rule_is_kept_and_sent_again_not_dropped(root, tmp_path):  # noqa: F811
    """403 (here: the relay's token file replaced by a worker's, which may not name members) refuses the request,
    not the batch: it stays pending and goes once the relay has its own token back."""
    root_app, _, admin, join = root
    relay = make_relay(root, tmp_path, "r1")
    service = relay.extensions["fedmoe"]
    try:
        token = token_at(relay, join, "wa")
        assert push(relay, token, random_like(make_adapter(), 1), "U1", 4, "wa").status_code == 202
        own = service.upstream.relay_token
        service.upstream.relay_token = token_at(root_app, join, "wa")
        assert service.forwarder.forward_once() == 0
        assert service.update_status("U1")["status"] == "pending" and service.store.pending_batch("e1") is not None
        service.upstream.relay_token = own
        assert service.forwarder.forward_once() == 1
        assert service.update_status("U1")["status"] == "forwarded" and admin.experts.get("e1")["samples_seen"] == 4
    finally:
        service.close()


@pytest.mark.parametrize("mode", ["reject", "clip"])
def test_the_roots_norm_check_applies_at_the_relay_before_the_202(tmp_path, mode):
    root_settings = {"norm_check": mode, "norm_warmup": 1, "norm_factor": 10.0, "staleness_decay": 0.0}
    with relay_sites(tmp_path, root=root_settings) as (at_root, relay, at_relay, _):
        assert relay.checks.limits == UpdateLimits(1.0, NormPolicy(mode, 10.0, 20, 1))  # learned when it joined
        w0 = at_root.experts.pull("e1", worker_id="w-root").tensors
        small, big = random_like(make_adapter(), 1), random_like(make_adapter(), 2, scale=100.0)
        send(at_relay, "w1", "U1", small, 4)
        norm = lambda d: float(torch.sqrt(sum((t.double() ** 2).sum() for t in d.values())))  # noqa: E731
        if mode == "reject":
            with pytest.raises(InvalidUpdate, match="over the limit"):
                send(at_relay, "w1", "U2", big, 4)
            assert [e["update_id"] for e in relay.events(10, kind="update_rejected")] == ["U2"]
            expected = {k: w0[k] + small[k] for k in w0}
        else:  # scaled down to 10 x the median of the relay's accepted norms, as the root would a direct push
            send(at_relay, "w1", "U2", big, 4)
            scale = 10.0 * norm(small) / norm(big)
            expected = {k: w0[k] + (small[k] + scale * big[k]) / 2 for k in w0}  # FedBuff's mean of the two
        assert relay.forwarder.flush() == 1
        got = at_root.experts.pull("e1", worker_id="w-root").tensors
        assert all(torch.allclose(got[k], expected[k], atol=1e-5) for k in w0)


def test_the_roots_limits_are_kept_for_a_restart_and_bad_ones_are_ignored(tmp_path):
    store = RelayStore(tmp_path / "relay.sqlite")
    blobs, guard = BlobStore(tmp_path / "blobs"), threading.RLock()
    try:
        checks = RelayChecks(store, blobs, guard)
        assert checks.limits == UpdateLimits()  # the root's defaults until it says otherwise
        learned = UpdateLimits(0.5, NormPolicy("reject", 5.0, 8, 2))
        checks.learn(learned.to_json())
        for bad in (None, {"server_lr": -1, "norm": learned.to_json()["norm"]}, {"server_lr": 1.0}, "x",
                    {"server_lr": 1.0, "norm": {"mode": "shout", "factor": 5, "history": 8, "warmup": 2}}):
            checks.learn(bad)
        assert checks.limits == learned and RelayChecks(store, blobs, guard).limits == learned
    finally:
        store.close()


def test_the_store_bisects_a_refused_batch_and_gives_back_the_residual_it_was_encoded_on(tmp_path):
    store = RelayStore(tmp_path / "relay.sqlite")
    try:
        for i in range(5):
            store.add_update("e1", {"update_id": f"u{i}", "worker_id": "w"}, f"blob{i}", 1)

        def batch(members: list[str], before: str | None, after: str) -> Batch:
            seq = store.next_seq("e1")
            made = Batch("e1", seq, f"r.x.e1.{seq}", {"members": dict.fromkeys(members, "b3-0")}, f"payload{seq}", 1,
                         len(members), len(members))
            store.add_batch(made, members, after, prev_residual=before)
            return made

        def ids(queued) -> list[str]:
            return [u.update_id for u in queued]

        assert ids(store.next_members("e1", 256)) == ["u0", "u1", "u2", "u3", "u4"]
        assert set(store.split_batch(batch(["u0", "u1", "u2", "u3", "u4"], None, "r1"))) == {"payload1", "r1"}
        assert store.residual("e1") is None  # the residual it was encoded on (none)
        store.add_update("e1", {"update_id": "u5", "worker_id": "w"}, "blob5", 1)
        assert ids(store.next_members("e1", 256)) == ["u0", "u1", "u2"]  # a half, and nothing new joins it
        store.split_batch(batch(["u0", "u1", "u2"], None, "r2"))
        assert ids(store.next_members("e1", 256)) == ["u3", "u4"]  # the older half first
        store.batch_done(batch(["u3", "u4"], None, "r3"), "forwarded")
        assert ids(store.next_members("e1", 256)) == ["u0", "u1"] and store.has_split_groups("e1")
        store.batch_done(batch(["u0", "u1"], "r3", "r4"), "forwarded")
        alone = batch(["u2"], "r4", "r5")
        assert set(store.batch_done(alone, "refused")) == {"blob2", "payload5", "r5"}
        assert store.residual("e1") == "r4"  # the refused batch's share of the residual is dropped with it
        assert ids(store.next_members("e1", 256)) == ["u5"] and not store.has_split_groups("e1")
        assert [store.update(f"u{i}")["batch_status"] for i in range(5)] == ["forwarded"] * 2 + ["refused"] + \
            ["forwarded"] * 2
        assert "blob2" not in store.referenced_blobs() and "r4" in store.referenced_blobs()
    finally:
        store.close()
