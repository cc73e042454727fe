"""Spectral grouping of a latency matrix (coordinator/grouping.py) on synthetic sites."""
from __future__ import annotations

import json

import numpy as np
import pytest

from coordinator.grouping import main, propose_groups


def sites_matrix(sizes: list[int], near: float = 2.0, far: float = 60.0, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """RTTs of nodes in sites: ~near ms inside a site, ~far ms across, with noise; shuffled order."""
    rng = np.random.default_rng(seed)
    site = np.repeat(np.arange(len(sizes)), sizes)
    order = rng.permutation(len(site))
    site = site[order]
    same = site[:, None] == site[None, :]
    rtt = np.where(same, near, far) * rng.uniform(0.7, 1.3, size=(len(site), len(site)))
    np.fill_diagonal(rtt, 0.0)
    return rtt, site.tolist()


def as_partition(groups, n):
    labels = [None] * n
    for i, g in enumerate(groups):
        for m in g.members:
            labels[m] = i
    return {frozenset(j for j in range(n) if labels[j] == labels[i]) for i in range(n)}


def test_three_sites_are_found_by_the_eigengap_with_a_relay_inside_each():
    rtt, site = sites_matrix([4, 3, 5])
    groups = propose_groups(rtt)
    assert len(groups) == 3
    expected = {frozenset(i for i, s in enumerate(site) if s == k) for k in set(site)}
    assert as_partition(groups, len(site)) == expected
    for g in groups:
        assert g.relay in g.members
        # the medoid: no member has less total latency to the group
        sym = (rtt + rtt.T) / 2  # measured each way; the helper uses the mean
        totals = {m: sum(sym[m][o] for o in g.members) for m in g.members}
        assert totals[g.relay] == min(totals.values())


def test_a_given_number_of_groups_and_one_flat_site():
    rtt, _ = sites_matrix([6])
    assert len(propose_groups(rtt)) == 1  # no gap stands out: one group
    assert len(propose_groups(sites_matrix([3, 3, 3, 3])[0], groups=2)) == 2


def test_bad_matrices_are_value_errors_and_the_cli_prints_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match="square"):
        propose_groups(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=">= 0"):
        propose_groups(np.array([[0, -1], [-1, 0]]))
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"nodes": ["a", "b", "c", "d"], "rtt_ms": sites_matrix([2, 2])[0].tolist()}))
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.count("group ") == 2
    path.write_text(json.dumps({"nodes": ["a"], "rtt_ms": [[0, 1]]}))
    assert main([str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
