"""The root's placement planner (coordinator/placement.py): groups from probe reports, a relay per group, hysteresis."""
import math

import pytest

from coordinator.placement import ROOT, Link, Placement, plan

WAN, LAN = 50.0, 1.0  # ms: a site's link to the root; inside a site


def site_reports(sites: int = 3, workers: int = 2, relays_in: tuple[int, ...] = (0, 1, 2)) -> dict[str, dict[str, Link]]:
    """Workers ``s<site>-w<i>``; site s has a relay ``r<s>`` (embedded in its first worker) if s is in ``relays_in``.
    Each worker measures the root across its site's WAN link and every relay: its own site's on the LAN, the
    others across two WAN links (or not at all: a site's namespace routes only to the root)."""
    reports = {}
    for s in range(sites):
        for i in range(workers):
            links = {ROOT: Link(WAN + 0.3 * i, 20.0)}
            for r in relays_in:
                links[f"r{r}"] = Link(LAN, 900.0) if r == s else Link(math.inf)
            reports[f"s{s}-w{i}"] = links
    return reports


def groups_of(p):
    return {g.members: g.relay for g in p.groups}


def test_three_sites_form_three_groups_each_at_its_own_site_s_relay():
    reports = site_reports()
    p = plan(reports, ["r0", "r1", "r2"])
    assert groups_of(p) == {("s0-w0", "s0-w1"): "r0", ("s1-w0", "s1-w1"): "r1", ("s2-w0", "s2-w1"): "r2"}
    assert plan(reports, ["r2", "r0", "r1"]) == p  # deterministic, whatever order the relays come in


def test_a_site_without_a_relay_host_syncs_with_the_root_and_so_does_a_lone_worker():
    reports = site_reports(relays_in=(0, 1))  # site 2 started no --can-relay worker
    reports["s3-w0"] = {ROOT: Link(WAN, 20.0), "r0": Link(math.inf), "r1": Link(math.inf)}  # a site of one
    for w in ("s2-w0", "s2-w1"):  # site 2's workers are close to each other (they measured the root alike)
        reports[w] = {ROOT: Link(WAN, 20.0), "r0": Link(math.inf), "r1": Link(math.inf)}
    p = plan(reports, ["r0", "r1"])
    assert p.host_of("s0-w1") == "r0" and p.host_of("s1-w0") == "r1"
    assert p.host_of("s2-w0") is None and p.host_of("s3-w0") is None and p.host_of("unknown") is None


def test_a_relay_no_closer_than_the_root_is_not_used():
    reports = {w: {ROOT: Link(WAN, 20.0), "far": Link(2 * WAN, 20.0)} for w in ("a", "b")}
    assert groups_of(plan(reports, ["far"])) == {("a", "b"): None}


def test_a_join_or_a_leave_regroups_at_once_and_link_jitter_never_does():
    now = [0.0]
    placement = Placement(clock=lambda: now[0])
    reports = site_reports()
    relays = ["r0", "r1", "r2"]
    for worker, links in sorted(reports.items())[:-1]:  # s2-w1 not here yet
        placement.report(worker, links, relays)
    before = placement.generation
    assert placement.report("s2-w1", reports["s2-w1"], relays)  # a join: adopted at once
    assert placement.assignment("s2-w1") == {"worker_id": "s2-w1", "relay_id": "r2", "generation": before + 1,
                                             "planned": True}
    jittered = {h: Link(link.rtt_ms * 1.25, link.mbps) for h, link in reports["s0-w0"].items()}
    now[0] += 100  # past the hold, within the reports' expiry
    assert not placement.report("s0-w0", jittered, relays)  # 25% slower RTTs: the same groups, nothing to do
    assert placement.forget(["s1-w1"], relays)  # a leave: s1-w0 is alone now, so it goes to the root at once
    assert placement.assignment("s1-w0")["relay_id"] is None
    assert not placement.forget(["nobody"], relays)
    now[0] += placement.expire_seconds + 1  # silent workers have left: the next report regroups without them
    assert placement.report("s0-w1", reports["s0-w1"], relays)
    assert placement.view()["groups"] == [{"members": ["s0-w1"], "relay_id": None}]


def test_a_link_change_moves_a_worker_only_when_it_is_much_better_and_the_plan_has_held_for_a_while():
    now = [0.0]
    placement = Placement(clock=lambda: now[0], hold_seconds=60, improvement=0.3)
    reports = site_reports(sites=2, relays_in=(0, 1))
    for worker, links in reports.items():
        placement.report(worker, links, ["r0", "r1"])
    assert placement.assignment("s0-w1")["relay_id"] == "r0"
    # site 0's relay host gets a slow, far link (its LAN went through a 2 Mbit/s VPN): the root is ~9x faster
    slow = {w: {**links, "r0": Link(2 * WAN, 2.0)} for w, links in reports.items() if w.startswith("s0")}
    now[0] += 10
    assert not placement.report("s0-w0", slow["s0-w0"], ["r0", "r1"])  # within the hold: kept
    now[0] += 60
    assert placement.report("s0-w1", slow["s0-w1"], ["r0", "r1"])  # held long enough and far faster at the root
    assert placement.assignment("s0-w1")["relay_id"] is None and placement.assignment("s1-w0")["relay_id"] == "r1"
    assert placement.view()["groups"] == [{"members": ["s0-w0", "s0-w1"], "relay_id": None},
                                          {"members": ["s1-w0", "s1-w1"], "relay_id": "r1"}]


@pytest.mark.parametrize("rtt, mbps, seconds", [(50.0, 20.0, 0.3 + 10 * 2**20 * 8 / 20e6), (math.inf, 20.0, math.inf),
                                                (1.0, 0.0, 0.006)])
def test_a_link_s_sync_estimate_is_round_trips_plus_the_bytes_at_its_rate(rtt, mbps, seconds):
    assert Link(rtt, mbps).sync_seconds() == pytest.approx(seconds)


def test_a_relay_a_worker_could_not_reach_at_first_is_used_as_soon_as_it_reaches_it_not_after_the_hold():
    """The e2e run stayed at the root: a worker that probed its site's relay while it was still starting reported it
    unreachable, the plan was made with that, and its next report (reachable now) was taken for jitter and held 60 s."""
    now = [0.0]
    placement = Placement(clock=lambda: now[0])
    reports = site_reports(sites=1, relays_in=(0,))
    starting = {**reports["s0-w1"], "r0": Link(math.inf)}
    placement.report("s0-w0", reports["s0-w0"], ["r0"])
    assert placement.report("s0-w1", starting, ["r0"])  # a join: adopted, but r0 is not reachable for s0-w1 yet
    assert placement.assignment("s0-w0")["relay_id"] is None
    now[0] += 4  # well within the hold
    assert placement.report("s0-w1", reports["s0-w1"], ["r0"])  # it reaches r0 now: adopted at once
    assert placement.view()["groups"] == [{"members": ["s0-w0", "s0-w1"], "relay_id": "r0"}]
