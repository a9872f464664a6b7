"""Matching rules: who mixes with whom in a round. Sans-I/O: plain functions of sizes, weights and an RNG.

A matching is returned as `partners[i]`, the list of workers that worker i mixes with this round. An empty list
means a solo round. Every function here is symmetric: j in partners[i] iff i in partners[j].

The simulator calls `round_partners` with a global view; a live peer, which has no global view, calls
`choose_partner` over the peers it currently sees as ready.
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Literal

Topology = Literal["complete", "random", "ring", "exponential"]
TOPOLOGIES: tuple[str, ...] = ("complete", "random", "ring", "exponential")

Edge = tuple[int, int]


def graph_edges(topology: Topology, k: int) -> list[Edge]:
    """The undirected edges (i < j) of a topology on k workers."""
    if k < 1:
        raise ValueError("need at least one worker")
    if topology in ("complete", "random"):
        return [(i, j) for i in range(k) for j in range(i + 1, k)]
    if topology == "ring":
        return sorted({tuple(sorted((i, (i + 1) % k))) for i in range(k) if k > 1 and (i + 1) % k != i})
    if topology == "exponential":
        # worker i is linked to i +- 2^m for 2^m < k (the "exponential graph" of decentralized SGD)
        edges = set()
        for i in range(k):
            m = 0
            while 2 ** m < k:
                j = (i + 2 ** m) % k
                if j != i:
                    edges.add(tuple(sorted((i, j))))
                m += 1
        return sorted(edges)
    raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")


def random_matching(k: int, edges: Sequence[Edge], rng: random.Random,
                    weights: Mapping[Edge, float] | None = None) -> list[list[int]]:
    """A random maximal one-peer matching over `edges`; an edge's chance to be picked first grows with its weight.

    Edges are ordered by the Efraimidis-Spirakis key u^(1/w) (weighted sampling without replacement) and taken
    greedily; with equal weights on the complete graph this is a uniform random pairing.
    """
    def key(e: Edge) -> float:
        w = 1.0 if weights is None else float(weights.get(e, weights.get((e[1], e[0]), 0.0)))
        return rng.random() ** (1.0 / w) if w > 0 else -1.0

    keyed = sorted(((key(e), e) for e in edges), reverse=True)
    partners: list[list[int]] = [[] for _ in range(k)]
    for kv, (i, j) in keyed:
        if kv < 0:
            continue  # zero weight: never matched
        if not partners[i] and not partners[j]:
            partners[i].append(j)
            partners[j].append(i)
    return partners


def round_partners(topology: Topology, k: int, rng: random.Random, *, num_partners: int = 1,
                   weights: Mapping[Edge, float] | None = None) -> list[list[int]]:
    """This round's partners for each of k workers.

    `complete`: everyone with everyone (mixing then gives the exact mean: DiLoCo's topology).
    Otherwise: `num_partners` (1 or 2) independent random matchings on the topology's edges, united; a worker left
    unmatched does a solo round. `weights` (per edge) biases which pairs are chosen, e.g. by link bandwidth.
    """
    if topology == "complete":
        return [[j for j in range(k) if j != i] for i in range(k)]
    if num_partners not in (1, 2):
        raise ValueError(f"num_partners must be 1 or 2, got {num_partners}")
    edges = graph_edges(topology, k)
    out: list[list[int]] = [[] for _ in range(k)]
    for _ in range(num_partners):
        for i, ps in enumerate(random_matching(k, edges, rng, weights)):
            out[i].extend(p for p in ps if p not in out[i])
    return out


def bandwidth_weights(k: int, bandwidth_bps: Sequence[float], edges: Sequence[Edge] | None = None
                      ) -> dict[Edge, float]:
    """Edge weights proportional to a pair's usable bandwidth: min of the two workers' link bandwidths."""
    edges = graph_edges("complete", k) if edges is None else edges
    return {(i, j): min(bandwidth_bps[i], bandwidth_bps[j]) for i, j in edges}


def choose_partner(candidates: Mapping[str, float], rng: random.Random) -> str | None:
    """A live peer's choice: one candidate id with probability proportional to its weight (e.g. measured bandwidth;
    use 1.0 everywhere for a uniform choice). Candidates with weight <= 0 or NaN are never chosen."""
    pool = [(c, w) for c, w in candidates.items() if w > 0 and math.isfinite(w)]
    if not pool:
        return None
    ids, ws = zip(*pool)
    return rng.choices(ids, weights=ws, k=1)[0]
