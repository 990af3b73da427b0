"""The n-gram drafter: longest-suffix matches over prompt + generated text, PPM-style back-off."""

from __future__ import annotations

import pytest

from dynatree.drafters import NgramDrafter
from dynatree.tree import TreeBuilder


def test_longest_match_wins_and_probabilities_back_off():
    d = NgramDrafter(max_n=3)
    d.reset([1, 2, 3, 9, 1, 2, 4, 7, 2, 3, 5, 1, 2])
    # context ...1 2: order 2 "1 2" was followed by 3 and 4 (once each): 1/3 each, escape 1/3
    # order 1 "2" was followed by 3, 4, 3 -> 3 already taken; nothing new. Then nothing else.
    dist = dict(d.distribution([1, 2], k=5))
    assert dist == pytest.approx({3: 1 / 3, 4: 1 / 3})
    # context "7 2": order 2 seen once (-> 3): 1/2; order 1 "2" (3:2, 4:1, total 3) adds 4 with 1/2 * 1/4
    dist = dict(d.distribution([7, 2], k=5))
    assert dist == pytest.approx({3: 0.5, 4: 0.125})
    assert sum(dist.values()) <= 1.0


def test_no_match_proposes_nothing():
    d = NgramDrafter(max_n=2)
    d.reset([1, 2, 3])
    assert d.distribution([42], k=3) == []


def test_tree_path_extends_the_context_and_commit_extends_the_index():
    d = NgramDrafter(max_n=2)
    d.reset([5, 6, 7, 5, 6, 8, 5])
    tree = TreeBuilder(5)
    node = tree.add(0, 6, 0.5)
    prop = d.propose(tree, [0, node], k=2)
    assert prop.candidates(0)[0][0] == 6  # after "... 5": 6 (twice)
    assert {t for t, _ in prop.candidates(1)} == {7, 8}  # after "5 6" (path token included): 7 or 8
    d.commit([5, 6, 7, 5, 6, 8, 5, 6, 9], path=[node])
    assert {t for t, _ in d.distribution([5, 6], k=3)} == {7, 8, 9}


def test_k_limits_candidates_most_probable_first():
    d = NgramDrafter(max_n=1)
    d.reset([1, 2, 1, 2, 1, 3, 1, 2, 1, 4])
    cands = d.distribution([1], k=2)
    assert [t for t, _ in cands] == [2, 3]
    assert cands[0][1] == pytest.approx(3 / 6)
