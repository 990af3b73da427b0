"""Hand-drawn trees with their expected BFS order, masks, positions, paths and accepted paths.

    root(10) ─┬─ a(11) ─┬─ c(13) ── f(16)
              │         └─ d(14)
              └─ b(12) ──── e(15)

BFS order: root=0, a=1, b=2, c=3, d=4, e=5, f=6.
"""

from __future__ import annotations

import pytest
import torch

from dynatree.tree import TreeBuilder, causal_allowed
from dynatree.verify import greedy_accept

NEG = torch.finfo(torch.float32).min


def drawn_tree():
    b = TreeBuilder(10)
    a, bb = b.add(0, 11, 0.6), b.add(0, 12, 0.3)
    c = b.add(a, 13, 0.5)
    b.add(a, 14, 0.25)
    b.add(bb, 15, 0.9)
    b.add(c, 16, 0.8)
    return b.build()


def test_bfs_order_parents_depths():
    t = drawn_tree()
    assert t.tokens.tolist() == [10, 11, 12, 13, 14, 15, 16]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.n_drafted == 6 and t.max_depth == 3
    assert torch.allclose(t.logp.exp(), torch.tensor([1, 0.6, 0.3, 0.3, 0.15, 0.27, 0.24], dtype=torch.float64))


def test_positions_are_prefix_plus_depth():
    assert drawn_tree().position_ids(7).tolist() == [[7, 8, 8, 9, 9, 9, 10]]


def test_mask_sees_prefix_and_ancestors_only():
    t = drawn_tree()
    mask = t.attention_mask(prefix_len=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 7, 9)
    allowed = (mask[0, 0] == 0).int().tolist()
    expected = [
        # p p  r a b c d e f
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # a
        [1, 1, 1, 0, 1, 0, 0, 0, 0],  # b
        [1, 1, 1, 1, 0, 1, 0, 0, 0],  # c
        [1, 1, 1, 1, 0, 0, 1, 0, 0],  # d
        [1, 1, 1, 0, 1, 0, 0, 1, 0],  # e
        [1, 1, 1, 1, 0, 1, 0, 0, 1],  # f
    ]
    assert allowed == expected
    assert set(mask.unique().tolist()) == {0.0, NEG}


def test_paths_root_to_leaf():
    assert drawn_tree().paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert drawn_tree().path_to(6) == [1, 3, 6]


def logits_predicting(preds: dict[int, int], n=7, vocab=100):
    """Logits whose argmax at node i is preds[i] (99 where unspecified)."""
    logits = torch.zeros(n, vocab)
    for i in range(n):
        logits[i, preds.get(i, 99)] = 1.0
    return logits


@pytest.mark.parametrize(
    "preds, path, bonus",
    [
        ({0: 11, 1: 13, 3: 16, 6: 42}, [1, 3, 6], 42),  # deepest path fully accepted
        ({0: 11, 1: 14, 4: 7}, [1, 4], 7),  # second child of a
        ({0: 12, 2: 77}, [2], 77),  # b accepted, e rejected
        ({0: 12, 2: 15, 5: 3}, [2, 5], 3),
        ({0: 11, 1: 13, 3: 5}, [1, 3], 5),  # f rejected
        ({0: 50}, [], 50),  # nothing accepted: the bonus is the target's own next token
        ({0: 13, 1: 13}, [], 13),  # c matches a's prediction, but a itself was not accepted
    ],
)
def test_greedy_accept(preds, path, bonus):
    assert greedy_accept(drawn_tree(), logits_predicting(preds)) == (path, bonus)


def test_root_only_tree_is_plain_decoding():
    t = TreeBuilder(5).build()
    assert t.paths.tolist() == [[0]]
    assert t.attention_mask(3, torch.float32)[0, 0].eq(0).all()
    assert greedy_accept(t, logits_predicting({0: 8}, n=1)) == ([], 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_accept_breaks_ties_at_the_first_maximal_token_as_argmax(dtype):
    """Tied maxima (common in bfloat16 logits) go to the lowest token id, as `argmax` (plain greedy
    decoding's rule) gives, for the root-only tree of plain decoding and for every row of a tree."""
    gen = torch.Generator().manual_seed(3)
    accepted = 0
    for _ in range(200):
        row = (torch.randn(1, 49152, generator=gen) * 0.4).round().to(dtype)  # many ties at the max
        assert greedy_accept(TreeBuilder(5).build(), row) == ([], int(row[0].argmax()))
        logits = (torch.randn(7, 17, generator=gen) * 0.4).round()
        logits[:, 11:] += 1  # the drawn tree's tokens 11-16 tie often at the max
        logits = logits.to(dtype)
        pred = logits.argmax(dim=-1).tolist()
        got = greedy_accept(drawn_tree(), logits)
        assert got == greedy_accept(drawn_tree(), logits_predicting(dict(enumerate(pred)), vocab=17))
        accepted += len(got[0]) > 0
    assert accepted > 20  # paths were accepted, so ties inside the tree were judged too


def test_builder_rejects_duplicate_siblings_and_zero_probability():
    b = TreeBuilder(1)
    assert b.add(0, 5, 0.5) == 1
    assert b.add(0, 5, 0.4) is None  # a sibling already holds token 5
    assert b.add(0, 6, 0.0) is None
    assert b.add(1, 5, 0.5) == 2  # same token under another parent is fine


def test_builder_requires_bfs_order():
    b = TreeBuilder(1)
    a = b.add(0, 5, 0.5)
    b.add(a, 6, 0.5)
    b.add(0, 7, 0.5)  # depth 1 after depth 2
    with pytest.raises(ValueError, match="breadth-first"):
        b.build()


def test_a_drafted_level_sees_the_committed_entries_its_fed_ancestors_and_itself():
    """Root 0 -> 1 -> 3 and 0 -> 2 -> 4: nodes 1 and 2 were fed at cache entries 5 and 6 after 5
    committed ones; level {3, 4} is fed at rows 7 and 8."""
    tree = TreeBuilder(9)
    for parent, token in [(0, 10), (0, 11), (1, 12), (2, 13)]:
        tree.add(parent, token, 0.5)
    allowed = tree.level_allowed([3, 4], {1: 5, 2: 6}, committed=5, base=7)
    assert allowed.int().tolist() == [[1, 1, 1, 1, 1, 1, 0, 1, 0],
                                      [1, 1, 1, 1, 1, 0, 1, 0, 1]]
    assert causal_allowed(2, 2).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
