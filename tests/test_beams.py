"""DSBD and MTAD (issue 33): the beam tree both draft, MTAD's joint-likelihood rule on a
hand-drawn tree, greedy equality of that rule, labels and bad input. Greedy exactness in the
engine is in test_exact/test_architectures/test_sliding; the sampling distribution (DSBD
lossless, MTAD lossy) in test_sampling."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from scipy.stats import chi2

from helpers import tiny
from dynatree import DynaTreeError, generate, make_config
from dynatree.decode import answer, draft
from dynatree.drafters.base import Proposal
from dynatree.methods import is_lossy
from dynatree.policies.beams import DsbdPolicy, MtadPolicy, grow_beams
from dynatree.sampling import Sampler, SamplingConfig
from dynatree.tree import TreeBuilder
from dynatree.verify import BeamVerifier, JointVerifier, greedy_accept

V = 8


class TableDrafter:
    """Answers from a table path -> [vocab] next-token distribution (uniform over 4 tokens when absent)."""

    name = "table"
    uses_target_hidden = False

    def __init__(self, table: dict[tuple[int, ...], list[float]], vocab: int = V):
        self.table = table
        self.vocab = vocab
        self.calls: list[list[int]] = []

    def dist(self, path: list[int]) -> torch.Tensor:
        row = self.table.get(tuple(path), [0.25, 0.25, 0.25, 0.25] + [0.0] * (self.vocab - 4))
        return torch.tensor(row, dtype=torch.float64)

    def propose(self, tree: TreeBuilder, nodes, k, full=False):
        self.calls.append(list(nodes))
        dist = torch.stack([self.dist(tree.path_tokens(u)) for u in nodes])
        top = dist.topk(k, dim=-1)
        ids = torch.where(top.values > 0, top.indices, torch.full_like(top.indices, -1))
        return Proposal(ids, top.values, dist if full else None, forwards=1)

    def without_model(self):
        return None

    def warm_up(self):
        return 0.0  # nothing compiled


TABLE = {(): [0.0, 0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0],  # after the root: 1 .5, 2 .3, 3 .2
         (1,): [0.0, 0.0, 0.0, 0.0, 0.4, 0.35, 0.25, 0.0],  # f: 4 .20, 5 .175, 6 .125
         (2,): [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],  # f: 7 .30
         (3,): [0.0, 0.0, 0.0, 0.0, 0.9, 0.1, 0.0, 0.0]}  # f: 4 .18, 5 .02


def test_greedy_beam_tree_keeps_the_width_best_pairs_of_each_layer_across_parents():
    drafter = TableDrafter(TABLE)
    tree = answer(grow_beams(root_token=0, width=3, depth=2, sampler=None), drafter)
    layer = {d: sorted((int(tree.tokens[tree.parents[u]]), int(tree.tokens[u]))
                       for u in range(tree.size) if tree.depths[u] == d) for d in (1, 2)}
    assert layer[1] == [(0, 1), (0, 2), (0, 3)]
    assert layer[2] == [(1, 4), (2, 7), (3, 4)]  # f .30 (2->7), .20 (1->4), .18 (3->4) beat .175 (1->5)
    assert [len(c) for c in drafter.calls] == [1, 3]  # one drafter call per layer, every beam expanded
    assert not tree.proposals  # greedy children are deterministic
    assert torch.allclose(tree.logp.exp()[tree.depths == 2].sort().values, torch.tensor([0.18, 0.2, 0.3],
                                                                                        dtype=torch.float64))


def test_beam_tree_stops_at_depth_and_when_nothing_is_proposed():
    tree = answer(grow_beams(0, width=4, depth=5, sampler=None), TableDrafter({(): [1.0] + [0.0] * (V - 1), (0,): [0.0] * V}))
    assert tree.tokens.tolist() == [0, 0]  # one proposal, then none
    tree = draft(DsbdPolicy(make_config("dsbd", width=2, depth=8)), TableDrafter({}), 0, max_depth=3)
    assert tree.max_depth == 3 and tree.n_drafted == 6


def test_sampled_beam_layers_draw_pairs_by_parent_mass_times_draft_probability():
    """Beam sampling: the first pair of layer 2 is (parent, token) with probability f(parent) q(token | parent)
    (chi-square over seeds); every layer has `width` distinct pairs; each parent's q is its proposal."""
    width, runs = 2, 3000
    counts: dict[tuple[int, int], int] = {}
    expected: dict[tuple[int, int], float] = {}
    for seed in range(runs):
        sampler = Sampler(SamplingConfig(), seed)
        tree = answer(grow_beams(0, width=width, depth=2, sampler=sampler), TableDrafter(TABLE))
        layer2 = [u for u in range(tree.size) if tree.depths[u] == 2]
        assert len(layer2) == width and int((tree.depths == 1).sum()) == width
        pairs = [(int(tree.parents[u]), int(tree.tokens[u])) for u in layer2]
        assert len(set(pairs)) == width
        for parent in {p for p, _ in pairs}:
            path = [int(tree.tokens[parent])]
            assert torch.allclose(tree.proposals[parent], TableDrafter(TABLE).dist(path))  # tempered at T=1
        first = (int(tree.tokens[tree.parents[layer2[0]]]), int(tree.tokens[layer2[0]]))
        counts[first] = counts.get(first, 0) + 1
        # P(first pair of layer 2 | layer 1) = f(parent) q(token | parent) / sum over layer 1's parents
        layer1 = [int(tree.tokens[u]) for u in range(tree.size) if tree.depths[u] == 1]
        mass = sum(TABLE[()][a] for a in layer1)
        for a in layer1:
            for b, q in enumerate(TABLE[(a,)]):
                if q > 0:
                    expected[(a, b)] = expected.get((a, b), 0.0) + TABLE[()][a] * q / mass / runs
    cells = sorted(expected)
    stat = sum((counts.get(c, 0) - expected[c] * runs) ** 2 / (expected[c] * runs) for c in cells)
    assert set(counts) <= set(cells)
    assert chi2.sf(stat, df=len(cells) - 1) > 1e-3


# ---- DSBD is lossless, exactly -------------------------------------------------------------
# Every way beam sampling can draw a width-2, depth-2 tree over 3 tokens, each with its
# probability, through the real `grow_beams` (its draws scripted); for each tree, the exact
# distribution of what recursive rejection sampling commits (`sample_accept`'s rule, computed,
# not sampled), completed to 3 tokens by the target. The sum must be the target's own 3-token
# distribution to rounding; trying a parent's children in another order than drawn must not be.

def ordered_draws(weights: list[float], k: int) -> list[tuple[list[int], float]]:
    """Every sequence of min(k, nonzero) distinct indices drawn one after another without
    replacement in proportion to the weights left, with its probability."""
    out, n = [], min(k, sum(w > 0 for w in weights))

    def extend(seq: list[int], prob: float, left: list[float]) -> None:
        if len(seq) == n:
            out.append((seq, prob))
            return
        total = sum(left)
        for i, w in enumerate(left):
            if w > 0:
                extend(seq + [i], prob * w / total, left[:i] + [0.0] + left[i + 1:])

    extend([], 1.0, list(weights))
    return out


def committed_distribution(tree, target: dict) -> dict[tuple[int, ...], float]:
    """The exact distribution of the tokens `sample_accept` commits on `tree` (path and bonus)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(parent, []).append(node)
    tokens, out = tree.tokens.tolist(), {}

    def walk(node: int, prefix: tuple[int, ...], prob: float) -> None:
        p = target[prefix].clone()
        q = tree.proposals.get(node)
        q = None if q is None else q.clone()
        reach = 1.0  # probability that every child tried so far was rejected
        for child in children.get(node, []):
            x = tokens[child]
            q_child = torch.nn.functional.one_hot(torch.tensor(x), len(p)).double() if q is None else q / q.sum()
            accept = min(1.0, float(p[x] / q_child[x])) if q_child[x] > 0 else 0.0
            if accept > 0:
                walk(child, prefix + (x,), prob * reach * accept)
            reach *= 1.0 - accept
            residual = (p - q_child).clamp(min=0.0)
            if float(residual.sum()) > 0:
                p = residual / residual.sum()
            if q is not None:
                q[x] = 0.0
        for y in range(len(p)):
            out[prefix + (y,)] = out.get(prefix + (y,), 0.0) + prob * reach * float(p[y])

    walk(0, (), 1.0)
    return out


def beam_sampled_output(monkeypatch, drafter, target: dict, width: int, reverse: bool) -> dict:
    """Sum over every beam-sampled tree of P(tree) x the committed distribution, completed to 3 tokens."""
    from dynatree.policies import beams

    script: list[list[int]] = []
    seen: list[list[float]] = []

    def scripted(weights, k, generator):
        seen.append(weights.tolist())
        draw = script[len(seen) - 1] if len(seen) <= len(script) else ordered_draws(weights.tolist(), k)[0][0]
        return list(reversed(draw)) if reverse else list(draw)

    monkeypatch.setattr(beams, "draw_without_replacement", scripted)
    sampler = Sampler(SamplingConfig(), seed=0)
    total: dict[tuple[int, ...], float] = {}

    def grow(draws: list[list[int]]):
        script[:], seen[:] = draws, []
        tree = answer(grow_beams(0, width=width, depth=2, sampler=sampler), drafter)
        return tree, [list(w) for w in seen]

    _, weights = grow([])
    for first, p1 in ordered_draws(weights[0], width):
        _, weights = grow([first])
        for second, p2 in ordered_draws(weights[1], width):
            tree, _ = grow([first, second])
            for seq, prob in committed_distribution(tree, target).items():
                for rest in itertools.product(range(3), repeat=3 - len(seq)):  # the target continues
                    full, p = seq + rest, prob
                    for i in range(len(seq), 3):
                        p *= float(target[full[:i]][full[i]])
                    total[full] = total.get(full, 0.0) + p1 * p2 * p
    return total


def test_dsbd_beam_trees_verified_by_rejection_sampling_commit_exactly_the_targets_distribution(monkeypatch):
    gen = torch.Generator().manual_seed(4)

    def dist() -> torch.Tensor:
        row = torch.rand(3, generator=gen, dtype=torch.float64) + 0.05
        return row / row.sum()

    paths = [()] + [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    target = {path: dist() for path in paths}
    drafter = TableDrafter({path: dist().tolist() for path in paths[:4]}, vocab=3)
    exact = {seq: float(target[()][seq[0]] * target[seq[:1]][seq[1]] * target[seq[:2]][seq[2]])
             for seq in itertools.product(range(3), repeat=3)}
    got = beam_sampled_output(monkeypatch, drafter, target, width=2, reverse=False)
    assert max(abs(got.get(s, 0.0) - p) for s, p in exact.items()) < 1e-12
    broken = beam_sampled_output(monkeypatch, drafter, target, width=2, reverse=True)  # children tried out of order
    assert max(abs(broken.get(s, 0.0) - p) for s, p in exact.items()) > 1e-4


# ---- MTAD's joint rule on a hand-drawn tree -------------------------------------------------

def hand_tree():
    """root -> a (token 1, q .5), b (token 2, q .3); a -> c (token 3, q .4); b -> d (token 4, q .1).
    Q: a .5, b .3, c .2, d .03."""
    builder = TreeBuilder(0)
    a, b = builder.add(0, 1, 0.5), builder.add(0, 2, 0.3)
    builder.add(a, 3, 0.4)
    builder.add(b, 4, 0.1)
    return builder.build()


def target_logits():
    """P: after root 1 .1, 2 .6; after a 3 .9; after b 4 .1; so P(a) .1, P(b) .6, P(c) .09, P(d) .06."""
    probs = torch.full((5, V), 1e-12, dtype=torch.float64)
    probs[0, 1], probs[0, 2], probs[0, 5] = 0.1, 0.6, 0.3
    probs[1, 3], probs[1, 6] = 0.9, 0.1
    probs[2, 4], probs[2, 7] = 0.1, 0.9
    probs[3, 6] = probs[4, 7] = 1.0
    return (probs / probs.sum(-1, keepdim=True)).log()


@pytest.mark.parametrize("tau, path, bonus", [
    (0.25, [1, 3], 6),  # depth 2, level max Q .2: c .09/.2 = .45 and d .06/.2 = .30 pass; c has the larger P
    (0.4, [1, 3], 6),  # only c; a alone (.1/.5 = .2) would not pass: its rejection does not block c
    (0.5, [2], 7),  # nothing at depth 2; at depth 1 (max Q .5) b passes with .6/.5 = 1.2
    (0.0, [1, 3], 6),  # every beam the target can produce passes: the deepest, most probable one
])
def test_joint_rule_on_a_hand_drawn_tree(tau, path, bonus):
    got = JointVerifier(tau).accept(hand_tree(), target_logits(), Sampler(SamplingConfig(), seed=0))
    assert got.path == path and got.bonus == bonus


def test_joint_rule_compares_with_the_levels_largest_draft_probability_not_the_beams_own():
    """d's own ratio is .06/.03 = 2 (WETAP's rule passes it at .5), its level's max Q is .2 (.3: MTAD's does not)."""
    sampler = Sampler(SamplingConfig(), seed=0)
    assert BeamVerifier(0.5).accept(hand_tree(), target_logits(), sampler).path == [2, 4]
    assert JointVerifier(0.5).accept(hand_tree(), target_logits(), sampler).path == [2]


def test_joint_rule_never_passes_a_beam_through_a_token_the_target_cannot_produce():
    logits = target_logits()
    logits[0, 2] = -float("inf")  # b impossible: d (and b) must never pass, whatever their ratios
    for seed in range(20):
        got = JointVerifier(0.0).accept(hand_tree(), logits, Sampler(SamplingConfig(), seed))
        assert 2 not in got.path and 4 not in got.path


@pytest.mark.parametrize("rule", [JointVerifier, BeamVerifier])
def test_deepest_beam_rules_greedy_equal_greedy_verification(rule):
    """Greedy, P is the target's 0/1 argmax: MTAD's joint rule and WETAP's beam rule are exactly
    `greedy_accept`, whatever their threshold."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        builder = TreeBuilder(0)
        for _ in range(int(torch.randint(0, 25, (), generator=gen))):
            parent = int(torch.randint(0, len(builder), (), generator=gen))
            token, prob = int(torch.randint(0, 4, (), generator=gen)), float(torch.rand((), generator=gen)) + 1e-3
            builder.add(parent, token, prob)
        order = sorted(range(len(builder)), key=lambda u: (builder.depths[u], u))
        tree = builder.build(keep=order)
        logits = torch.randn(tree.size, 4, generator=gen)
        for tau in (0.0, 0.5, 0.99):
            got = rule(tau).accept(tree, logits, None)
            assert (got.path, got.bonus) == greedy_accept(tree, logits), trial


# ---- labels and bad input ------------------------------------------------------------------

def test_mtad_is_labelled_lossy_when_sampling_and_dsbd_is_not():
    target = tiny("llama", eos_ids=[])
    assert is_lossy(make_config("mtad")) and not is_lossy(make_config("dsbd"))
    assert isinstance(MtadPolicy(make_config("mtad")).verifier, JointVerifier)
    assert DsbdPolicy(make_config("dsbd")).verifier is None  # the engine's lossless rule
    for method, lossy in (("mtad", True), ("dsbd", False)):
        sampled = generate(method=method, target=target, prompt_ids=[5, 6, 7, 5, 6], max_new_tokens=8, sample=True,
                           seed=0, ignore_eos=True)
        greedy = generate(method=method, target=target, prompt_ids=[5, 6, 7, 5, 6], max_new_tokens=8, ignore_eos=True)
        assert sampled.run.lossy is lossy and greedy.run.lossy is False


def test_the_paper_settings_are_the_defaults():
    """Paper 004, Appendix B.3: width 8 for fixed-width methods, tree length 8 (64 nodes)."""
    for method in ("dsbd", "mtad"):
        config = make_config(method)
        assert (config.width, config.depth) == (8, 8)
    assert make_config("mtad").joint_tau == 0.5


@pytest.mark.parametrize("method, options, message", [
    ("dsbd", {"width": 0}, "--width must be at least 1, got 0"),
    ("dsbd", {"depth": -2}, "--depth must be at least 1, got -2"),
    ("mtad", {"width": 0}, "--width must be at least 1, got 0"),
    ("mtad", {"joint_tau": 1.0}, "--joint-tau must be in [0, 1), got 1.0"),
    ("mtad", {"joint_tau": -0.1}, "--joint-tau must be in [0, 1), got -0.1"),
    ("dsbd", {"joint_tau": 0.5}, "option --joint-tau does not apply to method 'dsbd'"),
    ("mtad", {"width": "8"}, "--width of method 'mtad' must be int"),
])
def test_bad_options_are_one_line_errors(method, options, message):
    with pytest.raises(DynaTreeError, match=re.escape(message)):
        make_config(method, **options)
