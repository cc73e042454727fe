"""Propose relay groups from a measured latency matrix: spectral clustering (Ng, Jordan, Weiss 2001).

For operators placing relays: nodes close to each other (low RTT) should share a relay, so only
one combined update per group crosses the long link. Affinity ``exp(-d_ij^2 / (s_i s_j))`` with
s_i node i's nearest-neighbour RTT (local scaling); the normalised Laplacian's smallest eigenvectors embed the
nodes; k is the largest eigengap unless given; k-means (farthest-point start, deterministic) on
the row-normalised embedding gives the groups. Each group's proposed relay is its medoid (least
total latency to the rest of the group).

    python -m coordinator.grouping latencies.json [--groups K]

``latencies.json``: {"nodes": ["a", "b", ...], "rtt_ms": [[0, 1.2, ...], ...]}.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Group:
    members: list[int]
    relay: int
    """The member with the least total latency to the others: where its relay should run."""


def check_matrix(rtt: np.ndarray) -> np.ndarray:
    """A finite, non-negative square matrix, symmetrised (measured RTTs differ a little each way)."""
    rtt = np.asarray(rtt, dtype=np.float64)
    if rtt.ndim != 2 or rtt.shape[0] != rtt.shape[1] or rtt.shape[0] < 1:
        raise ValueError(f"the latency matrix must be square, got shape {rtt.shape}")
    if not np.isfinite(rtt).all() or (rtt < 0).any():
        raise ValueError("latencies must be finite and >= 0")
    rtt = (rtt + rtt.T) / 2
    np.fill_diagonal(rtt, 0.0)
    return rtt


def propose_groups(rtt: np.ndarray, groups: int | None = None, max_groups: int = 8) -> list[Group]:
    """Groups of nodes (indices into the matrix), each with its proposed relay node."""
    rtt = check_matrix(rtt)
    n = rtt.shape[0]
    if groups is not None and not 1 <= groups <= n:
        raise ValueError(f"groups must be 1-{n}, got {groups}")
    if n == 1:
        return [Group([0], 0)]
    # local scaling (Zelnik-Manor and Perona 2004): each node's scale is its nearest neighbour's RTT, so
    # a 2 ms site and a 40 ms one are both tight, and 60 ms across sites is far for every node
    scale = np.maximum(np.sort(rtt + np.diag(np.full(n, np.inf)), axis=1)[:, 0], 1e-3)
    affinity = np.exp(-(rtt ** 2) / (scale[:, None] * scale[None, :]))
    np.fill_diagonal(affinity, 0.0)
    inv_sqrt = 1.0 / np.sqrt(np.maximum(affinity.sum(axis=1), 1e-12))
    laplacian = np.eye(n) - inv_sqrt[:, None] * affinity * inv_sqrt[None, :]
    values, vectors = np.linalg.eigh(laplacian)  # ascending
    k = groups or _eigengap(values, min(max_groups, n))
    embedding = vectors[:, :k]
    embedding = embedding / np.maximum(np.linalg.norm(embedding, axis=1, keepdims=True), 1e-12)
    labels = _kmeans(embedding, k)
    out = []
    for label in sorted(set(labels.tolist()), key=lambda lab: int(np.flatnonzero(labels == lab)[0])):
        members = np.flatnonzero(labels == label).tolist()
        relay = members[int(np.argmin(rtt[np.ix_(members, members)].sum(axis=1)))]
        out.append(Group(members, relay))
    return out


def _eigengap(values: np.ndarray, max_k: int) -> int:
    """k with the largest gap between the k-th and (k+1)-th smallest eigenvalues (1 if none stands out)."""
    if max_k < 2:
        return 1
    gaps = np.diff(values[:max_k + 1])
    k = int(np.argmax(gaps)) + 1
    return k if gaps[k - 1] > 0.1 else 1


def _kmeans(points: np.ndarray, k: int, iterations: int = 100) -> np.ndarray:
    """Lloyd's k-means from a farthest-point start (deterministic: no random restarts needed here)."""
    centers = [points[0]]
    for _ in range(1, k):
        distance = np.min([np.sum((points - c) ** 2, axis=1) for c in centers], axis=0)
        centers.append(points[int(np.argmax(distance))])
    centers_arr = np.array(centers)
    labels = np.zeros(len(points), dtype=int)
    for _ in range(iterations):
        new = np.argmin(((points[:, None, :] - centers_arr[None, :, :]) ** 2).sum(axis=2), axis=1)
        if (new == labels).all() and _ > 0:
            break
        labels = new
        for j in range(k):
            if (labels == j).any():
                centers_arr[j] = points[labels == j].mean(axis=0)
    return labels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("matrix", help='JSON file: {"nodes": [...], "rtt_ms": [[...], ...]}')
    p.add_argument("--groups", type=int, default=None, help="number of groups (default: by eigengap)")
    args = p.parse_args(argv)
    try:
        with open(args.matrix, encoding="utf-8") as f:
            data = json.load(f)
        nodes, rtt = data["nodes"], np.array(data["rtt_ms"], dtype=np.float64)
        if len(nodes) != len(rtt):
            raise ValueError(f"{len(nodes)} nodes but a {len(rtt)}-row matrix")
        proposal = propose_groups(rtt, args.groups)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: {args.matrix}: {exc}", file=sys.stderr)
        return 2
    for i, g in enumerate(proposal):
        print(f"group {i}: relay on {nodes[g.relay]}; members {', '.join(nodes[m] for m in g.members)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
