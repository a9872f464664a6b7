"""Matching rules: symmetric, within the topology's edges, weighted by bandwidth when asked."""
import random
from collections import Counter

import pytest

from gasloc.protocol.matching import bandwidth_weights, choose_partner, graph_edges, random_matching, round_partners


def assert_symmetric(partners):
    for i, ps in enumerate(partners):
        for j in ps:
            assert i in partners[j] and j != i


@pytest.mark.parametrize("topology", ["random", "ring", "exponential"])
@pytest.mark.parametrize("k", [2, 5, 8])
def test_one_peer_matchings_are_symmetric_and_on_edges(topology, k):
    rng = random.Random(0)
    edges = set(graph_edges(topology, k))
    for _ in range(50):
        partners = round_partners(topology, k, rng)
        assert_symmetric(partners)
        for i, ps in enumerate(partners):
            assert len(ps) <= 1
            for j in ps:
                assert (min(i, j), max(i, j)) in edges


def test_random_matching_is_maximal_and_uniform_on_complete_graph():
    rng, k = random.Random(1), 8
    counts = Counter()
    for _ in range(4000):
        partners = round_partners("random", k, rng)
        assert all(len(ps) == 1 for ps in partners)  # even k: a perfect matching
        counts[partners[0][0]] += 1
    assert set(counts) == set(range(1, k))
    assert max(counts.values()) / min(counts.values()) < 1.3


def test_odd_k_leaves_one_worker_solo():
    partners = round_partners("random", 5, random.Random(2))
    assert sorted(len(ps) for ps in partners) == [0, 1, 1, 1, 1]


def test_graphs():
    assert graph_edges("ring", 4) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert set(graph_edges("exponential", 8)) >= {(0, 1), (0, 2), (0, 4), (3, 7)}
    assert (0, 3) not in graph_edges("exponential", 8)
    assert len(graph_edges("complete", 6)) == 15
    with pytest.raises(ValueError, match="unknown topology"):
        graph_edges("star", 4)


def test_complete_topology_pairs_everyone():
    partners = round_partners("complete", 4, random.Random(0))
    assert partners == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]


def test_two_partner_matching():
    rng = random.Random(3)
    for _ in range(50):
        partners = round_partners("random", 8, rng, num_partners=2)
        assert_symmetric(partners)
        assert all(1 <= len(ps) <= 2 and len(set(ps)) == len(ps) for ps in partners)


def test_bandwidth_weighted_matching_prefers_fast_pairs():
    k = 4  # workers 0, 1 fast; 2, 3 slow (10x)
    w = bandwidth_weights(k, [10.0, 10.0, 1.0, 1.0])
    rng, fast_pair = random.Random(4), 0
    for _ in range(2000):
        if random_matching(k, graph_edges("random", k), rng, w)[0] == [1]:
            fast_pair += 1
    # uniform would give 1/3; the fast pair's key dominates
    assert fast_pair / 2000 > 0.6


def test_zero_weight_edges_are_never_chosen():
    w = {(0, 1): 0.0, (0, 2): 1.0, (1, 2): 0.0}
    for s in range(20):
        partners = random_matching(3, [(0, 1), (0, 2), (1, 2)], random.Random(s), w)
        assert partners[1] == []


def test_choose_partner_weights_and_empty():
    rng = random.Random(5)
    assert choose_partner({}, rng) is None
    assert choose_partner({"a": 0.0, "b": float("nan")}, rng) is None
    picks = Counter(choose_partner({"a": 1.0, "b": 3.0}, rng) for _ in range(4000))
    assert 2.5 < picks["b"] / picks["a"] < 3.6
