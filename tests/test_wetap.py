"""WETAP (paper 004) and its tree baselines: width rule, pruning, beam verification,
pruned trees in the engine, and bad input."""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import ARCHS, ScriptedDrafter, assert_same_cache, chi_square_pvalue, noisy_copy, plain_cache, tiny
from dynatree import Decoder, DynaTreeError, make_config
from dynatree.decode import draft
from dynatree.drafters import LMDrafter
from dynatree.methods import METHODS
from dynatree.policies.baselines import OptTreePolicy, SpecExecPolicy, SpecInferPolicy
from dynatree.policies.wetap import WetapPolicy, next_width, prune
from dynatree.sampling import Sampler, SamplingConfig
from dynatree.tree import TreeBuilder
from dynatree.verify import BeamVerifier


# ---- width from entropy (eqs. 3-6) -------------------------------------------------------

def test_width_grows_with_the_layer_entropy():
    assert next_width([0.25] * 4, 16, 128, 1.2) == 128  # uniform layer: Hn = 1 -> W_max
    assert next_width([1.0, 0.0, 0.0], 16, 128, 1.2) == 16  # all mass on one node: Hn = 0 -> W_min
    assert next_width([0.7], 16, 128, 1.2) == 16  # a single node has no spread
    probs = [0.5, 0.3, 0.2]  # cumulative probabilities need not sum to 1: they are normalised (eq. 3)
    h = -sum(p * math.log(p) for p in probs) / math.log(3)
    assert next_width([p / 10 for p in probs], 16, 128, 1.2) == round(16 + 112 * h**1.2)
    assert next_width(probs, 16, 128, 0.2) > next_width(probs, 16, 128, 1.2) > next_width(probs, 16, 128, 8.0)


def test_layer_widths_follow_the_previous_layer():
    """Layer 1 has W_min nodes; later layers as many as eq. 5 gives for the layer above."""
    drafter = ScriptedDrafter(lambda path: [(10 + i, 1 / 8) for i in range(8)])  # uniform: Hn = 1 everywhere
    policy = WetapPolicy(make_config("wetap", depth=3, budget=1000, w_min=2, w_max=5, verify="exact"))
    tree = draft(policy, drafter, 1, max_depth=10)
    assert [int((tree.depths == d).sum()) for d in (1, 2, 3)] == [2, 5, 5]
    assert [len(call) for call in drafter.calls] == [1, 2, 5]  # one drafter call per layer

    peaked = ScriptedDrafter(lambda path: [(10, 0.97), (11, 0.02), (12, 0.01)])
    tree = draft(WetapPolicy(make_config("wetap", depth=3, budget=1000, w_min=2, w_max=5, gamma=1.0)), peaked, 1, 10)
    widths = [int((tree.depths == d).sum()) for d in (1, 2, 3)]
    assert widths[0] == 2 and widths[1] == next_width([0.97, 0.02], 2, 5, 1.0)

    fixed = WetapPolicy(make_config("wetap", depth=2, budget=1000, w_min=2, w_max=5, dynamic_width=False))
    tree = draft(fixed, ScriptedDrafter(lambda path: [(10 + i, 1 / 8) for i in range(8)]), 1, 10)
    assert [int((tree.depths == d).sum()) for d in (1, 2)] == [5, 5]  # the ablation: W_max everywhere


def test_layers_keep_the_most_probable_children_across_parents():
    script = {(): [(10, 0.6), (11, 0.4)], (10,): [(20, 0.5), (21, 0.5)], (11,): [(30, 0.9), (31, 0.1)]}
    drafter = ScriptedDrafter(lambda path: script.get(tuple(path), []))
    tree = draft(WetapPolicy(make_config("wetap", depth=2, budget=100, w_min=2, w_max=2)), drafter, 1, 10)
    layer2 = sorted(int(t) for t, d in zip(tree.tokens, tree.depths) if d == 2)
    assert layer2 == [20, 30]  # f = 0.36 (30) and 0.30 (20 or 21; 20 first) beat 0.30 / 0.04


# ---- pruning (section 3.2.2, Appendix D) ---------------------------------------------------

def build(nodes: list[tuple[str, str | None, float]]):
    """(name, parent name, cumulative probability) in BFS order -> parents, depths, probs, names."""
    names, parents, depths, probs = ["root"], [-1], [0], [1.0]
    for name, parent, prob in nodes:
        p = names.index(parent) if parent else 0
        names.append(name)
        parents.append(p)
        depths.append(depths[p] + 1)
        probs.append(prob)
    return parents, depths, probs, names


def test_pruning_example_shaped_like_appendix_d():
    """Appendix D's setting: length 4, widths 3, 5, 4, 4 (16 nodes), budget 12, alpha 0.6.
    The figure's own numbers are not in the text, so the probabilities are ours; the expected
    result is worked out by hand below."""
    parents, depths, probs, names = build([
        ("a", None, 0.5), ("b", None, 0.3), ("c", None, 0.2),
        ("a1", "a", 0.30), ("a2", "a", 0.15), ("b1", "b", 0.20), ("b2", "b", 0.06), ("c1", "c", 0.10),
        ("a1x", "a1", 0.20), ("b1x", "b1", 0.12), ("a2x", "a2", 0.08), ("c1x", "c1", 0.05),
        ("a1xy", "a1x", 0.15), ("b1xy", "b1x", 0.06), ("a2xy", "a2x", 0.04), ("c1xy", "c1x", 0.01),
    ])
    # score = 0.6 * (p - 0.01) / 0.49 + 0.4 * d / 4:
    #   a .700  a1xy .571  a1 .555  a1x .533  b1xy .461  b .455  a2xy .437  b1x .435  b1 .433
    #   c1xy .400  a2x .386  a2 .371  | c1x .349  c .333  c1 .310  b2 .261
    # 1. the best 12 leave out c1x, c, c1 and b2;
    # 2. c1xy's ancestors c1x, c1, c come back: 15 nodes;
    # 3. the leaves a1xy, b1xy, a2xy, c1xy all sit at depth 4: the least probable go first,
    #    c1xy, a2xy, b1xy, and the budget holds; step 4 is not needed.
    keep = prune(parents, depths, probs, length=4, budget=12, alpha=0.6)
    assert sorted(names[v] for v in keep) == sorted(["a", "b", "c", "a1", "a2", "b1", "c1", "a1x", "b1x", "a2x", "c1x", "a1xy"])


def test_pruning_removes_shallow_leaves_first():
    parents, depths, probs, names = build([
        ("x", None, 0.9), ("y", None, 0.05), ("z", None, 0.04),
        ("x1", "x", 0.5), ("z1", "z", 0.03), ("z2", "z1", 0.02),
    ])
    # alpha 0: depth alone. Best 3: z2, then x1 and z1 (tie, smaller index first); x and z come
    # back (5 nodes); leaves x1 (depth 2) then z2 (depth 3) are removed.
    keep = prune(parents, depths, probs, length=3, budget=3, alpha=0.0)
    assert sorted(names[v] for v in keep) == ["x", "z", "z1"]


def test_pruning_falls_back_to_lowest_probability():
    parents, depths, probs, names = build([
        ("a", None, 0.5), ("s", None, 0.45), ("b", "a", 0.4), ("c", "b", 0.3), ("d", "c", 0.2),
    ])
    # alpha 0, budget 1: d is chosen, a b c come back (4 nodes), the only leaf d goes (3 nodes),
    # then the least probable leaf each time: c, then b.
    assert [names[v] for v in prune(parents, depths, probs, length=4, budget=1, alpha=0.0)] == ["a"]


def test_pruning_with_alpha_one_is_top_probability():
    parents, depths, probs, names = build([
        ("a", None, 0.6), ("b", None, 0.3), ("a1", "a", 0.5), ("b1", "b", 0.1), ("a2", "a1", 0.45),
    ])
    assert sorted(names[v] for v in prune(parents, depths, probs, length=3, budget=3, alpha=1.0)) == ["a", "a1", "a2"]


def test_pruned_tree_is_a_valid_tree_with_its_builder_indices():
    drafter = ScriptedDrafter(lambda path: [(10 + i, 0.5 / (i + 1)) for i in range(6)])
    tree = draft(WetapPolicy(make_config("wetap", depth=4, budget=9, w_min=3, w_max=6)), drafter, 1, 10)
    assert tree.n_drafted == 9
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert all(parents[i] < i and depths[i] == depths[parents[i]] + 1 for i in range(1, tree.size))
    assert tree.source[0] == 0 and len(set(tree.source)) == tree.size  # builder indices, for the drafter


# ---- deep-to-shallow beam verification (eq. 9, Algorithm 1) ----------------------------

def hand_tree():
    """root -> a (q .5) -> c (q .4); root -> b (q .3) -> d (q .5). Tokens a=1 b=2 c=3 d=4."""
    builder = TreeBuilder(0)
    a, b = builder.add(0, 1, 0.5), builder.add(0, 2, 0.3)
    builder.add(a, 3, 0.4)
    builder.add(b, 4, 0.5)
    return builder.build()


def target_logits(p_b: float = 0.6):
    """Target: after root P(a)=.1 P(b)=p_b; after a P(c)=.9; after b P(d)=.1; one-token rows after c, d."""
    probs = torch.full((5, 8), 1e-12, dtype=torch.float64)
    probs[0, 1], probs[0, 2], probs[0, 5] = 0.1, p_b, 0.9 - p_b
    probs[1, 3], probs[1, 6] = 0.9, 0.1
    probs[2, 4], probs[2, 7] = 0.1, 0.9
    probs[3, 6] = probs[4, 7] = 1.0
    return (probs / probs.sum(-1, keepdim=True)).log()


@pytest.mark.parametrize("tau, path, bonus", [
    (0.3, [1, 3], 6),  # depth 2: c (P .09, Q .2, ratio .45) and d (.06/.15 = .4) pass; c has the larger P
    (0.42, [1, 3], 6),  # only c passes; its parent a alone (.1/.5 = .2) would not: no propagation of rejection
    (0.46, [2], 7),  # nothing at depth 2; at depth 1 b passes (.6/.3 capped at 1)
])
def test_beam_rule_on_a_hand_drawn_tree(tau, path, bonus):
    sampler = Sampler(SamplingConfig(), seed=0)
    got = BeamVerifier(tau).accept(hand_tree(), target_logits(), sampler)
    got_path, got_bonus = got.path, got.bonus
    assert got_path == path
    if bonus in (6, 7) and got_path:  # rows after c and d put all mass on one token
        assert got_bonus == bonus


def test_beam_rule_with_nothing_accepted_samples_from_the_root():
    """With no beam passing, only the bonus is committed, drawn from the target's distribution at the
    root (not a residual, not its argmax): over 2000 seeds its counts fit P = (.1, .2, .7) for a, b, 5."""
    logits = target_logits(p_b=0.2)
    counts: dict[tuple, int] = {}
    for seed in range(2000):
        got = BeamVerifier(0.9).accept(hand_tree(), logits, Sampler(SamplingConfig(), seed=seed))
        assert got.path == []
        counts[(got.bonus,)] = counts.get((got.bonus,), 0) + 1
    expected = {(token,): float(p) for token, p in enumerate(torch.softmax(logits[0], -1))}
    assert chi_square_pvalue(counts, expected, 2000) > 1e-3
    assert counts[(5,)] > counts[(2,)] > counts[(1,)] > 100  # all three drawn, most often the likeliest


# ---- the policies in the engine ----------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method, options", [
    ("wetap", {"depth": 4, "budget": 10, "w_min": 2, "w_max": 6, "verify": "beam"}),
    ("specexec", {"budget": 12, "depth": 5, "expand": 3, "branch": 3}),
    ("opt-tree", {"budget": 12, "depth": 5}),
    ("specinfer", {"width": 3, "depth": 4}),
])
def test_pruned_trees_keep_the_draft_cache_right(arch, method, options):
    """Pruning renumbers nodes: the draft cache must still hold exactly the committed tokens."""

    target, draft = tiny(arch, eos_ids=[]), noisy_copy(arch, 0, 0.08)
    drafter = LMDrafter(draft, target.vocab_size)
    decoder = Decoder(target, METHODS[method].policy_cls(make_config(method, **options)), drafter)
    accepted = 0
    for step in decoder.steps([7, 8, 9, 7, 8], max_new_tokens=40, ignore_eos=True):
        assert_same_cache(decoder.run.cache, plain_cache(target.model, decoder.run.seq[:-1]))
        assert_same_cache(drafter.cache, plain_cache(draft.model, decoder.run.seq[: drafter.n_cached]))
        accepted += len(step.path)
    assert accepted > 0


def test_specinfer_is_a_fork_of_chains():
    drafter = ScriptedDrafter(lambda path: [(10 + i, 0.4 - 0.1 * i) for i in range(4)])
    tree = draft(SpecInferPolicy(make_config("specinfer", width=3, depth=4)), drafter, 1, 10)
    assert tree.n_drafted == 12
    children = torch.bincount(tree.parents[1:], minlength=tree.size)
    assert int(children[0]) == 3 and all(int(c) <= 1 for c in children[1:])


def test_specexec_and_opt_tree_keep_the_most_probable_nodes():
    """Both end with the budget's worth of the most probable continuations the drafter offers."""
    probs = [0.5, 0.3, 0.15, 0.05]
    drafter = lambda: ScriptedDrafter(lambda path: [(10 + i, p) for i, p in enumerate(probs)])  # noqa: E731
    for policy in (SpecExecPolicy(make_config("specexec", budget=6, depth=3, expand=2, branch=4)),
                   OptTreePolicy(make_config("opt-tree", budget=6, depth=3))):
        tree = draft(policy, drafter(), 1, max_depth=10)
        got = sorted(round(math.exp(x), 6) for x in tree.logp[1:].tolist())
        # all paths of <= 3 tokens, best 6: .5 .3 .25 (.5 .5) and three of .15 (.15; .5 .3; .3 .5)
        assert got == sorted([0.5, 0.3, 0.25, 0.15, 0.15, 0.15]), type(policy).__name__


def test_opt_tree_delta_stops_growth():
    drafter = ScriptedDrafter(lambda path: [(10, 0.5), (11, 0.3)])
    tree = draft(OptTreePolicy(make_config("opt-tree", budget=50, depth=6, delta=0.5)), drafter, 1, 10)
    # expected accepted length gains per layer: .8, .64, .512, then .4096 < .5: layer 4 is left out
    assert tree.max_depth == 3 and tree.n_drafted == 2 + 4 + 8


# ---- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"alpha": 1.5}, "--alpha must be in [0, 1]"),
    ({"alpha": -0.1}, "--alpha must be in [0, 1]"),
    ({"w_min": 64, "w_max": 16}, "--w-min must not exceed --w-max"),
    ({"gamma": 0.0}, "--gamma must be > 0"),
    ({"gamma": -1.0}, "--gamma must be > 0"),
    ({"verify": "fast"}, "--verify must be one of beam, exact"),
    ({"beam_tau": 1.0}, "--beam-tau must be in [0, 1)"),
    ({"budget": 0}, "--budget must be at least 1"),
])
def test_bad_wetap_options(options, message):
    with pytest.raises(DynaTreeError, match=re.escape(message)):
        make_config("wetap", **options)
