"""Tree policies against a scripted drafter: shapes, breadth/depth rules, pruning, budget, history."""

from __future__ import annotations

import math
import time

import pytest
import torch

from helpers import ScriptedDrafter
from dynatree import make_config
from dynatree.decode import answer, draft
from dynatree.policies.base import Timing
from dynatree.policies.dynatree import DynaTreePolicy
from dynatree.policies.simple import LinearPolicy, FixedTreePolicy
from dynatree.tree import TreeBuilder


def uniform(n: int, first: float = 0.5):
    """n candidates: `first`, then the rest of the mass spread evenly; tokens 100, 101, ..."""
    rest = (1 - first) / max(n - 1, 1)
    return lambda path: [(100 + i, first if i == 0 else rest) for i in range(n)]


def test_linear_is_a_chain_of_k():
    drafter = ScriptedDrafter(uniform(3, first=0.9))
    tree = draft(LinearPolicy(make_config("linear", k=4)), drafter, root_token=1, max_depth=10)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert tree.tokens.tolist() == [1, 100, 100, 100, 100]
    assert len(drafter.calls) == 4


def test_a_policy_asks_and_is_answered_without_holding_a_drafter():
    """The policy contract: `grow` yields one `Ask` per drafter call and is sent the proposal; no
    drafter in sight. Here the fixed tree's two levels are answered by hand."""
    import torch

    from dynatree.drafters.base import Proposal

    growing = FixedTreePolicy(make_config("fixed-tree", depth=2, branch=2, tau=0.0)).grow(1, max_depth=10)
    ask = next(growing)
    assert (ask.nodes, ask.k, ask.full, ask.model_free) == ([0], 2, False, False) and len(ask.tree) == 1
    ask = growing.send(Proposal(torch.tensor([[7, 8]]), torch.tensor([[0.6, 0.4]], dtype=torch.float64)))
    assert ask.nodes == [1, 2] and ask.tree.tokens[1:] == [7, 8]
    with pytest.raises(StopIteration) as done:
        growing.send(Proposal(torch.tensor([[9, -1], [10, 11]]), torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)))
    tree = done.value.value
    assert tree.tokens.tolist() == [1, 7, 8, 9, 10, 11] and tree.parents.tolist() == [-1, 0, 0, 1, 2, 2]


def test_the_decoder_refuses_an_ask_it_has_no_drafter_for():
    with pytest.raises(ValueError, match="^a tree policy asked for proposals without a drafter$"):
        draft(LinearPolicy(make_config("linear", k=2)), None, 1, max_depth=10)
    from dynatree.costmodel import CostCurve

    policy = dynatree(cost_aware=True)
    policy.prepare(CostCurve((1, 2), (0.1, 0.2)), model_free=True)  # told of a model-free part the drafter lacks
    policy.gate.idle = 1  # idle
    with pytest.raises(ValueError, match="^a tree policy asked for the model-free part of scripted, which has none$"):
        draft(policy, ScriptedDrafter(uniform(2)), 1, max_depth=10)


def test_fixed_tree_full_shape_one_drafter_call_per_level():
    drafter = ScriptedDrafter(uniform(4))
    tree = draft(FixedTreePolicy(make_config("fixed-tree", depth=3, branch=2, tau=0.0)), drafter, 1, max_depth=10)
    assert tree.n_drafted == 2 + 4 + 8
    assert [len(c) for c in drafter.calls] == [1, 2, 4]  # a whole level per call
    assert tree.depths.tolist() == [0] + [1] * 2 + [2] * 4 + [3] * 8


def test_fixed_tree_budget_keeps_most_probable():
    drafter = ScriptedDrafter(lambda path: [(7, 0.7), (8, 0.3)])
    tree = draft(FixedTreePolicy(make_config("fixed-tree", depth=3, branch=2, tau=0.0, n_max=5)), drafter, 1, 10)
    assert tree.n_drafted == 5
    # level 1: 0.7, 0.3; level 2 candidates: .49 .21 .21 .09 -> keep .49 and the two .21
    assert sorted(tree.logp.exp().tolist(), reverse=True) == pytest.approx([1, 0.7, 0.49, 0.3, 0.21, 0.21])


def test_fixed_tree_tau_prunes_unlikely_nodes():
    drafter = ScriptedDrafter(lambda path: [(7, 0.7), (8, 0.3)])
    tree = draft(FixedTreePolicy(make_config("fixed-tree", depth=4, branch=2, tau=0.25)), drafter, 1, 10)
    assert (tree.logp.exp() >= 0.25).all()
    assert tree.n_drafted == 4  # .7 .3 | .49 .21x | .343 x | x
    assert tree.max_depth == 3


def test_max_depth_from_the_decoder_caps_every_policy():
    for policy in (LinearPolicy(make_config("linear", k=8)),
                   FixedTreePolicy(make_config("fixed-tree", depth=8, branch=2)),
                   DynaTreePolicy(make_config("dynatree"))):
        tree = draft(policy, ScriptedDrafter(uniform(3, 0.95)), 1, max_depth=2)
        assert tree.max_depth == 2, policy  # capped, not empty: each would go deeper
        assert draft(policy, ScriptedDrafter(uniform(3)), 1, max_depth=0).n_drafted == 0


def dynatree(**options):
    defaults = dict(history=False, tau=0.0, rho_stop=0.001, rho_deep=0.002)
    return DynaTreePolicy(make_config("dynatree", **{**defaults, **options}))


@pytest.mark.parametrize("confidence, children", [(0.95, 1), (0.9, 1), (0.6, 2), (0.4, 2), (0.3, 3)])
def test_dynatree_breadth_follows_confidence(confidence, children):
    policy = dynatree(d0=1, d_max=2, b_min=1, b_mid=2, b_max=3, tau_h=0.9, tau_l=0.4)
    tree = draft(policy, ScriptedDrafter(uniform(4, first=confidence)), 1, max_depth=1)
    assert tree.n_drafted == children


def test_dynatree_depth_gating():
    # confident chain: p(depth d) = 0.8^d. D0=2, rho_deep=0.6 -> depth 2 (p=.64) expands, depth 3 (.512) does not
    script = lambda path: [(5, 0.8), (6, 0.2)]  # noqa: E731
    policy = dynatree(d0=2, d_max=6, b_min=1, b_mid=1, b_max=1, tau_h=0.7, tau_l=0.1, rho_stop=0.05, rho_deep=0.6)
    assert draft(policy, ScriptedDrafter(script), 1, 10).max_depth == 3
    # a hard d_max wins over a likely path
    policy = dynatree(d0=1, d_max=2, b_min=1, b_mid=1, b_max=1, tau_h=0.7, tau_l=0.1, rho_stop=0.05, rho_deep=0.06)
    assert draft(policy, ScriptedDrafter(script), 1, 10).max_depth == 2
    # early stop: nodes below rho_stop stay leaves even above D0
    policy = dynatree(d0=5, d_max=6, b_min=2, b_mid=2, b_max=2, tau_h=0.7, tau_l=0.1, rho_stop=0.5, rho_deep=0.9)
    tree = draft(policy, ScriptedDrafter(script), 1, 10)
    # expanded: root(1) -> .8 -> .64 -> .512; the next (.4096) and every .2-branch stay leaves
    assert tree.n_drafted == 8 and tree.max_depth == 4
    assert sorted(tree.logp.exp().tolist())[:2] == pytest.approx([0.1024, 0.128])


def test_dynatree_budget():
    policy = dynatree(d0=6, d_max=7, b_min=3, b_mid=3, b_max=3, n_max=10)
    tree = draft(policy, ScriptedDrafter(uniform(3, first=0.5)), 1, 10)
    assert tree.n_drafted == 10


def test_dynatree_tau_prunes():
    policy = dynatree(d0=3, d_max=4, b_min=3, b_mid=3, b_max=3, tau=0.2)
    tree = draft(policy, ScriptedDrafter(lambda path: [(5, 0.6), (6, 0.3), (7, 0.1)]), 1, 10)
    assert (tree.logp.exp() >= 0.2 - 1e-12).all()
    assert tree.n_drafted == 4  # .6 .3 | .36 (.18s pruned) | .216 (.1296 pruned)


NO_TIME = Timing(draft_s=0.0, verify_s=0.0)  # what the decoder measured (the history rule ignores it)


def fake_tree(n_drafted: int):
    b = TreeBuilder(1)
    node = 0
    for i in range(n_drafted):
        node = b.add(node, 10 + i, 0.9)
    return b.build()


def test_history_adapts_every_iteration():
    policy = DynaTreePolicy(make_config("dynatree", d0=4, d_max=8, tau_h=0.8, tau_l=0.4, history_window=4,
                                       target_accept=0.5, eta_depth=2.0, eta_tau=0.1))
    tree = fake_tree(10)
    d0s, taus = [], []
    for _ in range(3):  # acceptance 1.0 > a* = 0.5: deeper and fewer branches, every iteration
        policy.observe(tree, list(range(1, 11)), 0, NO_TIME)
        d0s.append(policy.d0)
        taus.append(policy.tau_h)
    assert d0s == pytest.approx([5.0, 6.0, 7.0])
    assert taus == pytest.approx([0.75, 0.70, 0.65])
    for _ in range(4):  # acceptance 0: the window mean falls below a*, drafting becomes conservative
        policy.observe(tree, [], 0, NO_TIME)
    assert policy.d0 < 7.0 and policy.tau_h > 0.65
    for _ in range(40):
        policy.observe(tree, [], 0, NO_TIME)
    assert policy.d0 == 1.0 and policy.tau_h == 1.0
    for _ in range(80):
        policy.observe(tree, list(range(1, 11)), 0, NO_TIME)
    assert policy.d0 == 7.0 and policy.tau_h == 0.4  # clipped to [1, d_max - 1] and [tau_l, 1]


def test_history_window_mean_and_switch():
    policy = DynaTreePolicy(make_config("dynatree", d0=4, history_window=2, target_accept=0.5, eta_depth=1.0))
    policy.observe(fake_tree(4), [1, 2, 3, 4], 0, NO_TIME)  # a = 1.0 -> mean 1.0
    policy.observe(fake_tree(4), [], 0, NO_TIME)  # a = 0.0 -> mean 0.5 -> no change
    assert policy.d0 == pytest.approx(4.5)
    policy.observe(fake_tree(0), [], 0, NO_TIME)  # nothing drafted: no acceptance signal, no update
    assert policy.d0 == pytest.approx(4.5)
    frozen = DynaTreePolicy(make_config("dynatree", history=False))
    frozen.observe(fake_tree(4), [1, 2, 3, 4], 0, NO_TIME)
    assert (frozen.d0, frozen.tau_h) == (5.0, 0.9)


def test_adapted_depth_changes_the_next_tree():
    policy = dynatree(d0=1, d_max=8, b_min=1, b_mid=1, b_max=1, rho_deep=0.99, history=True,
                      target_accept=0.2, eta_depth=10.0, history_window=1)
    drafter = ScriptedDrafter(uniform(2, first=0.95))
    assert draft(policy, drafter, 1, 10).max_depth == 1
    policy.observe(fake_tree(1), [1], 0, NO_TIME)  # acceptance 1.0: D0 1 -> 7
    assert draft(policy, drafter, 1, 10).max_depth == 7


# ---------------------------------------------------------------- cost-aware tree size (issue 5)
def test_cost_curve_interpolates_and_extrapolates():
    from dynatree.costmodel import CostCurve

    curve = CostCurve((1, 2, 4), (0.10, 0.12, 0.20))
    assert curve.at(1) == 0.10 and curve.at(2) == 0.12
    assert curve.at(3) == pytest.approx(0.16)
    assert curve.at(6) == pytest.approx(0.28)  # last slope (0.04 per token) beyond the last size


def test_best_size_maximises_expected_tokens_per_second():
    from dynatree.costmodel import CostCurve, best_rate

    flat = CostCurve((1, 64), (0.1, 0.1))  # verification free of size: verify everything
    assert best_rate([0.9, 0.5, 0.01], flat)[0] == 3
    steep = CostCurve((1, 2, 3, 4), (0.1, 0.2, 0.3, 0.4))  # each token costs a full pass: verify nothing
    assert best_rate([0.9, 0.5], steep)[0] == 0
    curve = CostCurve((1, 2, 3, 4), (0.10, 0.11, 0.15, 0.30))
    # k=0: 1/0.10 = 10; k=1: 1.9/0.11 = 17.3; k=2: 2.4/0.15 = 16; k=3: 2.5/0.30 = 8.3
    assert best_rate([0.5, 0.9, 0.1], curve)[0] == 1


def test_best_size_counts_the_drafting_time():
    from dynatree.costmodel import CostCurve, best_rate

    curve = CostCurve((1, 2), (0.1, 0.2))
    assert best_rate([0.6], curve)[0] == 0  # 1/0.1 = 10 beats 1.6/0.2 = 8
    assert best_rate([0.6], curve, draft_s=0.3)[0] == 1  # 1/0.4 = 2.5 loses to 1.6/0.5 = 3.2: drafting is sunk


def test_grow_levels_asks_stop_after_each_drafter_call():
    from dynatree.policies.base import grow_levels

    drafter = ScriptedDrafter(uniform(2, first=0.9))
    asked = []

    def stop(tree, growth):
        asked.append((growth.levels, growth.forwards, len(tree)))
        return growth.levels == 2

    grown = answer(grow_levels(1, max_depth=6, n_max=64, max_breadth=1, expandable=lambda d, p: True,
                               breadth=lambda c: 1, stop=stop), drafter)
    assert asked == [(1, 1, 2), (2, 2, 3)] and len(drafter.calls) == 2  # one forward per call
    assert grown.tree.build().max_depth == 2 and (grown.growth.levels, grown.growth.forwards) == (2, 2)


def test_cost_aware_dynatree_stops_growing_at_the_first_level_not_worth_verifying():
    from dynatree.costmodel import CostCurve

    # Verifying 2 tokens (root + 1) is nearly free, a third costs a whole pass: only one drafted
    # node pays, and the look-ahead sees that a second level cannot, so one drafter call, not d_max.
    drafter = ScriptedDrafter(lambda path: [(100, 0.9)])
    policy = dynatree(cost_aware=True, d0=7, d_max=8, history=False)
    policy.prepare(CostCurve((1, 2, 3), (1.0, 1.01, 2.0)), model_free=False)
    tree = draft(policy, drafter, 1, max_depth=10)
    assert tree.parents.tolist() == [-1, 0] and len(drafter.calls) == 1
    drafter.calls.clear()
    policy.prepare(CostCurve((1, 2, 3, 4), (1.0, 1.01, 1.02, 3.0)), model_free=False)  # a third token nearly free too: two levels
    tree = draft(policy, drafter, 1, max_depth=10)
    assert tree.parents.tolist() == [-1, 0, 1] and len(drafter.calls) == 2
    drafter.calls.clear()
    policy.prepare(CostCurve((1, 64), (1.0, 1.0)), model_free=False)  # free verification: the whole chain to d_max
    tree = draft(policy, drafter, 1, max_depth=10)
    assert tree.n_drafted == 8 and len(drafter.calls) == 8

    drafter.calls.clear()
    # Not convex: 3 tokens cost as much as 9, so one more level never pays but seven more do.
    policy.prepare(CostCurve((1, 2, 3, 9), (1.0, 1.5, 3.0, 3.0)), model_free=False)
    tree = draft(policy, ScriptedDrafter(lambda path: [(100, 0.99)]), 1, max_depth=10)
    assert tree.n_drafted == 8


def test_calibration_learns_acceptance_per_draft_probability():
    from dynatree.costmodel import Calibration

    cal = Calibration(bins=10, prior=4.0, decay=1.0)  # plain counts
    assert cal(0.45) == pytest.approx(0.45) and cal(1.0) == pytest.approx(0.95)  # unseen: trust the draft
    # root 0 -> node 1 (q = 0.5) -> node 2 (q = 0.5); node 3 (q = 0.5) is a child of the rejected node 4.
    parents = [-1, 0, 1, 4, 0]
    logp = [0.0, math.log(0.5), 2 * math.log(0.5), math.log(0.1) + math.log(0.5), math.log(0.1)]
    for _ in range(36):
        cal.observe(parents, logp, accepted={0, 1, 2})  # q = 0.5 nodes accepted; node 3 never tried
    assert cal(0.55) == pytest.approx((4 * 0.55 + 72) / (4 + 72))
    assert cal(0.15) == pytest.approx((4 * 0.15 + 0) / (4 + 36))  # node 4 (q = 0.1) tried and rejected


def test_calibration_learns_model_and_lookup_proposals_apart():
    from dynatree.costmodel import Calibration

    cal = Calibration(bins=10, prior=4.0, decay=1.0)
    # root -> node 1 (a model's, q = 0.5, the target's choice) and node 2 (a lookup's, q = 0.5, not it)
    parents, logp, tokens = [-1, 0, 0], [0.0, math.log(0.5), math.log(0.5)], [1, 50, 60]
    for _ in range(40):
        cal.observe_choices(parents, logp, tokens, {0: 50}, modelled=[False, True, False])
    assert cal(0.55, True) == pytest.approx((4 * 0.55 + 40) / 44)
    assert cal(0.55, False) == pytest.approx(4 * 0.55 / 44)
    cal.observe(parents, logp, {0, 2}, modelled=[False, True, False])  # sampling: the verified nodes' outcome
    assert cal(0.55, False) == pytest.approx((4 * 0.55 + 1) / 45) and cal(0.55, True) == pytest.approx((4 * 0.55 + 40) / 45)
    assert cal.table(True)[5] == cal(0.55, True)


def test_cost_aware_dynatree_judges_a_hybrids_model_and_lookup_nodes_each_by_its_own_record():
    """Both sources offer one child at q = 0.45; the model's is always the target's choice, the
    lookup's never. Verifying a second token costs 1.6x a plain step, so a node pays only when its
    acceptance exceeds 0.6: learnt apart, the model's node is verified and the lookup's cut; one
    table for both (about 0.5 each) would cut both."""
    from dynatree.costmodel import CostCurve
    from dynatree.drafters import Proposal

    class TwoSources:
        name, model = "two-sources", True

        def propose(self, tree, nodes, k, full=False):
            token = 51 if self.model else 61
            return Proposal(torch.tensor([[token]]), torch.tensor([[0.45]], dtype=torch.float64),
                            forwards=int(self.model), modelled=torch.tensor([self.model]))

        def without_model(self):
            return None

    drafter = TwoSources()
    curve = CostCurve((1, 2), (0.05, 0.08))
    policy = dynatree(cost_aware=True, d0=1, d_max=2, history=False)
    policy.prepare(curve, model_free=False)
    kept = {True: [], False: []}
    for i in range(200):
        drafter.model = i % 2 == 0
        tree = draft(policy, drafter, 1, max_depth=1)
        choice = 51 if drafter.model else 99  # the target's token after the root
        path = [1] if tree.n_drafted and int(tree.tokens[1]) == choice else []
        bonus = 7 if path else choice
        kept[drafter.model].append(tree.n_drafted)
        policy.observe(tree, path, bonus, Timing(draft_s=1e-4, verify_s=curve.at(tree.size)))
    assert sum(kept[True][-20:]) == 20, kept[True]  # the model's node: verified every time
    assert sum(kept[False][-20:]) == 0  # the lookup's: cut every time
    assert policy.state()["calibration"]["model"][4] > 0.9 > 0.1 > policy.state()["calibration"]["lookup"][4]


def test_calibration_forgets_so_a_draft_that_improves_is_learnt_back():
    from dynatree.costmodel import Calibration

    cal = Calibration()  # default decay: old trials fade
    for hit in [False] * 200 + [True] * 40:
        cal._count(0.95, hit, False)
    assert cal(0.95) > 0.5
    plain = Calibration(decay=1.0)
    for hit in [False] * 200 + [True] * 40:
        plain._count(0.95, hit, False)
    assert plain(0.95) < 0.2


def test_cost_aware_dynatree_stops_calling_a_draft_that_does_not_pay_and_probes_back():
    from dynatree.costmodel import CostCurve

    # A draft that costs 20 ms per call (40% of a target step) and is never right, then always right.
    drafter = ScriptedDrafter(lambda path: [(100 + len(path), 0.95)])
    curve = CostCurve((1, 2, 8), (0.05, 0.051, 0.06))
    policy = dynatree(cost_aware=True, d0=3, d_max=4, history=False)
    policy.prepare(curve, model_free=False)
    calls, sizes = [], []
    root = 1
    for i in range(120):
        right = i >= 60
        before = len(drafter.calls)
        tree = draft(policy, drafter, root, max_depth=10)
        calls.append(len(drafter.calls) - before)
        sizes.append(tree.n_drafted)
        path = [] if not right else list(range(1, tree.n_drafted + 1))
        root = (100 + len(path)) if right else 7  # the target's choice (the bonus): never the draft's while wrong
        policy.observe(tree, path, root, Timing(draft_s=0.02 * calls[-1], verify_s=curve.at(len(tree.tokens))))
    assert sum(calls[40:60]) <= 3, calls  # wrong and dear: at most a probe or two in 20 iterations
    assert policy.gate.idle_iterations > 30
    assert all(c > 0 for c in calls[100:]), calls  # right again: drafting every iteration
    assert sum(sizes[100:]) > sum(sizes[80:100]) >= 20  # and deeper as acceptance is learnt back


def test_cost_aware_dynatree_cuts_trees_and_stays_exact():
    from helpers import hf_greedy, noisy_copy, tiny
    from dynatree.api import generate
    from dynatree.costmeasure import _CURVES
    from dynatree.costmodel import CostCurve

    target = tiny("llama", seed=1)
    draft = noisy_copy("llama", 1, 0.3)
    prompt = [5, 6, 7, 8, 9]
    full = generate(prompt_ids=prompt, method="dynatree", target=target, draft=draft, max_new_tokens=20,
                    ignore_eos=True, history=False)
    _CURVES[target.model] = {(False, False): CostCurve((1, 2, 3), (0.1, 0.105, 0.3))}  # two tokens nearly free, then expensive
    # (the tiny model's real steps take well under a millisecond: the learnt extra cost of a
    # verification, measured minus curve, is about -0.1 s for one token and for trees alike)
    try:
        cut = generate(prompt_ids=prompt, method="dynatree", target=target, draft=draft, max_new_tokens=20,
                       ignore_eos=True, history=False, cost_aware=True)
    finally:
        del _CURVES[target.model]
    assert cut.new_token_ids == full.new_token_ids == hf_greedy(target, prompt, 20)
    assert cut.policy_state["cost_curve_ms"] == {1: 100.0, 2: 105.0, 3: 300.0}  # recorded with the run
    assert "cost_curve_ms" not in full.policy_state
    assert full.stats.drafted_tokens > cut.stats.drafted_tokens
    assert cut.stats.drafted_tokens <= cut.stats.iterations - 1  # at most one node per verification


def test_cost_curve_is_measured_once_per_compile_setting(monkeypatch):
    from helpers import tiny
    from dynatree import costmeasure

    target = tiny("llama", seed=1)
    timed = []

    def fake_measure(lm, context, masked_token=False, compiled=False):
        timed.append(compiled)
        return costmeasure.CostCurve((1,), (0.05 if compiled else 0.1,))

    monkeypatch.setattr(costmeasure, "measure", fake_measure)
    try:
        assert costmeasure.curve_for(target, [5]).seconds == (0.1,)
        assert costmeasure.curve_for(target, [5]).seconds == (0.1,)  # reused
        assert costmeasure.curve_for(target, [5], compiled=True).seconds == (0.05,)  # compiled steps on their own
        assert costmeasure.curve_for(target, [5], compiled=True).seconds == (0.05,)
    finally:
        costmeasure._CURVES.pop(target.model, None)
    assert timed == [False, True] and target.compile is False


def test_cost_curve_times_whole_sweeps_after_an_untimed_one(monkeypatch):
    from helpers import tiny
    from dynatree import costmeasure

    target = tiny("llama", seed=1)
    calls = []
    real = type(target).forward

    def forward(self, cache, ids, positions, mask, last_only=False, compiled=None):
        calls.append(len(ids))
        # calls 2-3: the untimed first sweep, as slow as building compiled graphs; calls 6-7: a
        # slow spell of the machine during the second timed sweep, which the median leaves out
        if len(calls) in (2, 3, 6, 7):
            time.sleep(0.3)
        return real(self, cache, ids, positions, mask, last_only, compiled=compiled)

    monkeypatch.setattr(type(target), "forward", forward)
    curve = costmeasure.measure(target, [5, 6, 7], sizes=(1, 2), rounds=3)
    assert calls == [3] + [1, 2] * 4  # the prefill, then 1 untimed + 3 timed sweeps over the sizes
    assert max(curve.seconds) < 0.3


def test_cost_curve_throws_away_a_timed_sweep_that_compiled(monkeypatch):
    """A graph built during a timed sweep (the cost of compiling, not of the step) is not learnt
    from: that sweep is swept again (issue 36: a compiled run ended with L 1.00, no drafting)."""
    from helpers import tiny
    from dynatree import costmeasure

    target = tiny("llama", seed=1)
    calls, graphs = [], [0]
    real = type(target).forward

    def forward(self, cache, ids, positions, mask, last_only=False, compiled=None):
        calls.append(len(ids))
        if len(calls) == 5:  # the timed sweep's size-2 step "compiles": slow, and a new graph
            graphs[0] += 1
            time.sleep(0.3)
        return real(self, cache, ids, positions, mask, last_only, compiled=compiled)

    monkeypatch.setattr(type(target), "forward", forward)
    monkeypatch.setattr(costmeasure, "compiled_graphs", lambda: graphs[0])
    curve = costmeasure.measure(target, [5, 6, 7], sizes=(1, 2), rounds=1)  # one timed sweep: no median to hide in
    assert calls == [3] + [1, 2] * 3  # the prefill, 1 untimed sweep, the timed one and the one swept again
    assert max(curve.seconds) < 0.3


def test_cost_curve_runs_one_token_without_a_mask_as_the_decoder_does(monkeypatch):
    from helpers import tiny
    from dynatree import costmeasure

    target = tiny("llama", seed=1)
    masks = {}
    real = type(target).forward

    def forward(self, cache, ids, positions, mask, last_only=False, compiled=None):
        masks.setdefault(len(ids), mask is None)
        return real(self, cache, ids, positions, mask, last_only, compiled=compiled)

    monkeypatch.setattr(type(target), "forward", forward)
    costmeasure.measure(target, [5, 6, 7, 8], sizes=(1, 2, 3), rounds=1)
    assert masks == {4: True, 1: True, 2: False, 3: False}  # the prefill and one token plain; trees masked
    masks.clear()
    costmeasure.measure(target, [5, 6, 7, 8], sizes=(1, 2, 3), rounds=1, masked_token=True)  # as under a KV window
    assert masks == {4: True, 1: False, 2: False, 3: False}


def test_measured_cost_curve_is_non_decreasing():
    from helpers import tiny
    from dynatree.costmeasure import measure

    curve = measure(tiny("gpt2"), [5, 6, 7], sizes=(1, 4, 16), rounds=2)
    assert curve.sizes == (1, 4, 16) and all(a <= b for a, b in zip(curve.seconds, curve.seconds[1:]))
    assert curve.seconds[0] > 0


def test_cost_curve_is_the_median_of_the_timed_sweeps_made_non_decreasing(monkeypatch):
    """On a scripted clock: the first (untimed) sweep is left out, each size gets its median over the
    timed sweeps, and a size that looks cheaper than a smaller one is raised to it."""
    from types import SimpleNamespace

    from helpers import tiny
    from dynatree import costmeasure

    target = tiny("gpt2")
    costs = {1: [1.0, 0.010, 0.012, 0.011], 4: [1.0, 0.008, 0.009, 0.007], 16: [1.0, 0.020, 0.030, 0.025]}
    clock, calls, forward = [0.0], {1: 0, 4: 0, 16: 0}, target.forward

    def scripted(cache, ids, positions, mask, **kwargs):
        out = forward(cache, ids, positions, mask, **kwargs)
        if len(ids) in calls and "last_only" not in kwargs:  # (the context's own forward costs nothing here)
            clock[0] += costs[len(ids)][calls[len(ids)]]
            calls[len(ids)] += 1
        return out

    monkeypatch.setattr(target, "forward", scripted)
    monkeypatch.setattr(costmeasure, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    curve = costmeasure.measure(target, [5, 6, 7], sizes=(1, 4, 16), rounds=3)
    assert calls == {1: 4, 4: 4, 16: 4}
    assert curve.sizes == (1, 4, 16)
    assert curve.seconds == pytest.approx((0.011, 0.011, 0.025))


def test_cost_curve_is_measured_before_the_clock_starts(monkeypatch):
    """The one-time curve measurement (seconds on a real target) is set-up, not decoding time."""
    import time

    from helpers import tiny
    from dynatree import Decoder
    from dynatree.drafters import NgramDrafter
    from dynatree import decode as module
    from dynatree.costmodel import CostCurve

    seen = []

    def slow_curve(target, context, masked_token=False, compiled=False):
        seen.append(list(context))
        time.sleep(1.0)
        return CostCurve((1, 2), (0.01, 0.011))

    monkeypatch.setattr(module, "curve_for", slow_curve)
    policy = DynaTreePolicy(make_config("dynatree", cost_aware=True, history=False))
    run = Decoder(tiny("gpt2"), policy, NgramDrafter(max_n=3)).generate([5, 6, 7, 5, 6], 4, ignore_eos=True)
    assert seen == [[5, 6, 7, 5, 6]] and run.stats.new_tokens == 4
    assert run.stats.ttft_s < 1.0 and run.stats.wall_s < 1.0


def test_cost_aware_dynatree_learns_from_cut_nodes_when_greedy():
    from dynatree.costmodel import CostCurve
    from dynatree.sampling import Sampler, SamplingConfig

    # A chain drafter that says 1/2 for every token (as the n-gram drafter does for a continuation
    # seen once) and that the target always follows. Verifying any drafted node costs 2.5x a
    # one-token step: on the draft's word (about half accepted per level) no tree pays, so nothing
    # is verified; the target's choice after each tree (the next root) shows the cut first node
    # would have been accepted, and the policy starts verifying chains.
    drafter = ScriptedDrafter(lambda path: [(100 + len(path), 0.5)])
    curve = CostCurve((1, 2, 9), (1.0, 2.5, 2.6))
    policy = dynatree(cost_aware=True, d0=7, d_max=8)
    policy.prepare(curve, model_free=False)
    sizes, root = [], 1
    for _ in range(12):
        tree = draft(policy, drafter, root, max_depth=10)
        sizes.append(tree.n_drafted)
        path = list(range(1, tree.n_drafted + 1))  # the target accepts every verified node
        root = 100 + len(path)  # the bonus token: the target's choice after the last accepted node
        policy.observe(tree, path, root, Timing(draft_s=0.0, verify_s=curve.at(len(tree.tokens))))
    assert sizes[0] == 0 and sizes[-1] == 8, sizes

    # Sampling: the next root is a draw, not the target's choice; only verified nodes are learnt from.
    policy = dynatree(cost_aware=True, d0=7, d_max=8)
    policy.prepare(curve, model_free=False)
    sampler = Sampler(SamplingConfig())
    for _ in range(12):
        tree = draft(policy, drafter, 100, max_depth=10, sampler=sampler)
        policy.observe(tree, [], 7, Timing(draft_s=0.0, verify_s=curve.at(len(tree.tokens))))
        assert tree.n_drafted == 0


def _step(policy, drafter, root, curve, per_call_s, accept=True, bonus=1):
    """One iteration against a scripted drafter: grow, then observe the timings the decoder would
    report (`per_call_s` per drafter forward, the curve's time for verification, the target's choice
    `bonus` after the accepted path)."""
    before = len(drafter.calls)
    tree = draft(policy, drafter, root, max_depth=10)
    path = list(range(1, tree.n_drafted + 1)) if accept else []
    policy.observe(tree, path, bonus, Timing(draft_s=per_call_s * (len(drafter.calls) - before),
                                             verify_s=curve.at(len(tree.tokens))))
    return tree


def test_cost_aware_dynatree_idles_after_an_accepted_tree_that_did_not_pay():
    """Accepted nodes do not cancel an idle spell unless the tree was a probe: a draft that is right
    but costs 4 target steps per call never pays on this curve. Its cost is learnt from the timings
    the decoder reports (the first tree is drafted as if drafting were free)."""
    from dynatree.costmodel import CostCurve

    curve = CostCurve((1, 2, 8), (0.005, 0.0051, 0.006))
    policy = dynatree(cost_aware=True, d0=1, d_max=2, history=False)
    policy.prepare(curve, model_free=False)
    drafter = ScriptedDrafter(lambda path: [(100 + len(path), 0.95)])
    assert _step(policy, drafter, 1, curve, 0.02, bonus=101).n_drafted >= 1 and policy.gate.idle == 0  # cost not known yet
    assert policy.costs.forward_s == pytest.approx(0.02)
    tree = draft(policy, drafter, 101, max_depth=10)
    assert policy.gate.idle == 1 and tree.n_drafted >= 1
    policy.observe(tree, list(range(1, tree.n_drafted + 1)), 7, Timing(0.02, curve.at(len(tree.tokens))))
    assert policy.gate.idle == 1  # not a probe: the spell stands
    calls = len(drafter.calls)
    assert draft(policy, drafter, 7, max_depth=10).n_drafted == 0 and policy.gate.idle_iterations == 1
    assert len(drafter.calls) == calls  # no drafter call while idle


def test_cost_aware_dynatree_declines_only_the_model_part_of_a_drafter():
    """While the draft model does not pay, a drafter with a model-free part (a hybrid's n-gram
    copying) still drafts with that part; trees drafted without a model never start an idle spell."""
    from dynatree.costmodel import CostCurve

    class Free(ScriptedDrafter):
        def propose(self, tree, nodes, k, full=False):
            proposal = super().propose(tree, nodes, k, full)
            proposal.forwards = 0  # lookups, as the n-gram drafter's
            return proposal

        def without_model(self):
            return self

    free = Free(lambda path: [(200 + len(path), 0.9)])

    class Hybrid(ScriptedDrafter):
        def without_model(self):
            return free

    curve = CostCurve((1, 2, 8), (0.005, 0.0051, 0.006))
    policy = dynatree(cost_aware=True, d0=1, d_max=2, history=False)
    policy.prepare(curve, model_free=True)
    dear = Hybrid(lambda path: [(100 + len(path), 0.95)])
    _step(policy, dear, 1, curve, 0.02)  # learns that a model call costs 20 ms
    _step(policy, dear, 1, curve, 0.02)  # does not pay: an idle spell starts
    assert policy.gate.idle >= 1
    calls, tree = len(dear.calls), _step(policy, dear, 1, curve, 0.02)
    assert len(dear.calls) == calls and free.calls  # idle: the free part drafted, the model was not asked
    assert tree.n_drafted >= 1 and tree.tokens[1].item() == 200

    policy = dynatree(cost_aware=True, d0=1, d_max=2, history=False)  # lookups that never pay their verification
    policy.prepare(CostCurve((1, 2, 8), (0.005, 0.05, 0.06)), model_free=True)
    wrong = Free(lambda path: [(300, 0.3)])
    for _ in range(10):
        _step(policy, wrong, 1, curve, 0.0001, accept=False)
    assert policy.gate.idle == 0 and policy.gate.idle_iterations == 0 and len(wrong.calls) == 10

def test_cost_aware_dynatree_keeps_a_draft_that_pays_on_average_though_most_probes_fail():
    """A cheap draft, wrong for a while (the policy idles), then right 45% of the time: most single
    probes gain nothing, but on average (1.45 tokens per pass for 1.12x the time of a plain step)
    drafting pays, so the policy learns that from its probes and drafts again instead of idling
    ever longer after every missed probe."""
    from dynatree.costmodel import CostCurve

    curve = CostCurve((1, 2, 8), (0.05, 0.051, 0.06))
    policy = dynatree(cost_aware=True, d0=1, d_max=2, history=False)
    policy.prepare(curve, model_free=False)
    drafter = ScriptedDrafter(lambda path: [(100, 0.95)])
    idle = {}
    for i in range(400):
        right = i >= 100 and i % 20 < 9
        before = len(drafter.calls)
        tree = draft(policy, drafter, 1, max_depth=10)
        path = [1] if right and tree.n_drafted else []
        policy.observe(tree, path, 1, Timing(draft_s=0.005 * (len(drafter.calls) - before),
                                             verify_s=curve.at(len(tree.tokens))))
        idle[i] = policy.gate.idle_iterations
    assert idle[99] > 30  # the wrong spell was declined
    assert idle[399] - idle[199] < 40, idle[399] - idle[199]  # the last 200 iterations draft


def test_learnt_verification_costs_never_make_a_tree_look_free():
    """A tree verified much faster than the curve says (a fast spell of the machine) lowers the
    learnt tree cost, but never below half the curve's forward: no size looks free."""
    from dynatree.costmodel import CostCurve, IterationCosts, best_rate

    costs = IterationCosts(CostCurve((1, 2, 8), (0.05, 0.06, 0.08)))
    costs.learn(levels=1, forwards=0, verified=8, draft_s=0.0, verify_s=0.001)
    assert costs.extra_s[1] < 0 and costs.at(8) == pytest.approx(0.04) and costs.at(2) == pytest.approx(0.03)
    assert costs.at(1) == pytest.approx(0.05)  # one-token steps are learnt apart
    assert best_rate([0.9, 0.9], costs, draft_s=0.0)[1] < 1e3  # finite, no division by zero


def test_a_probe_can_lower_a_draft_forward_cost_raised_while_the_model_idled_but_never_raise_it():
    """A probe's first model call also feeds the tokens of the idle spell, so its time is an upper bound
    of a usual forward: learnt only when below the estimate. Otherwise a forward cost raised by a slow
    spell of the machine stayed up while the model idled (idle iterations run no model) and kept the
    probes from ever judging that drafting pays."""
    from dynatree.costmodel import CostCurve, IterationCosts

    costs = IterationCosts(CostCurve((1, 2), (0.05, 0.06)))
    costs.learn(levels=2, forwards=2, verified=3, draft_s=0.040, verify_s=0.06)  # a slow spell: 20 ms a forward
    assert costs.forward_s == pytest.approx(0.020)
    costs.learn(levels=2, forwards=2, verified=3, draft_s=0.100, verify_s=0.06, catch_up=True)  # dearer: not learnt
    assert costs.forward_s == pytest.approx(0.020)
    costs.learn(levels=2, forwards=2, verified=3, draft_s=0.008, verify_s=0.06, catch_up=True)  # 4 ms: learnt
    assert costs.forward_s == pytest.approx(0.8 * 0.020 + 0.2 * 0.004)
    costs.learn(levels=2, forwards=2, verified=3, draft_s=0.100, verify_s=0.06)  # a usual tree is always learnt
    assert costs.forward_s > 0.020


def test_a_probe_after_an_idle_spell_lowers_the_policys_draft_cost_but_a_dearer_one_does_not_raise_it():
    """Through the policy: a model learnt at 20 ms a call idles; the probe after the spell (its first
    call also feeds the spell's tokens) is learnt only when it shows a cheaper forward."""
    from dynatree.costmodel import CostCurve

    curve = CostCurve((1, 2, 8), (0.005, 0.0051, 0.006))
    for probe_s, want in ((0.001, 0.8 * 0.02 + 0.2 * 0.001), (0.1, 0.02)):
        policy = dynatree(cost_aware=True, d0=1, d_max=2, history=False)
        policy.prepare(curve, model_free=False)
        dear = ScriptedDrafter(lambda path: [(100 + len(path), 0.95)])
        _step(policy, dear, 1, curve, 0.02)
        _step(policy, dear, 1, curve, 0.02)  # does not pay: an idle spell starts
        assert policy.gate.idle >= 1 and policy.costs.forward_s == pytest.approx(0.02)
        while policy.gate.idle:
            _step(policy, dear, 1, curve, 0.02)  # idle: the root alone, no drafter call
        calls = len(dear.calls)
        _step(policy, dear, 1, curve, probe_s, accept=False)
        assert policy._probe and len(dear.calls) > calls
        assert policy.costs.forward_s == pytest.approx(want), probe_s


def test_the_draft_gate_idles_probes_and_backs_off():
    """gate.py on its own: a tree that did not pay starts a one-iteration spell, then a probe; a probe
    that does not pay doubles the spell (up to backoff_max) unless it beat plain steps (halved), and
    one that pays resumes drafting."""
    from dynatree.policies.gate import DRAFT, IDLE, PROBE, DraftGate

    gate = DraftGate(backoff_max=4)
    assert gate.begin() == DRAFT
    gate.drafted(paid=True)
    assert gate.begin() == DRAFT
    gate.drafted(paid=False)
    assert [gate.begin()] == [IDLE] and gate.begin() == PROBE
    gate.probed(pays_now=False, beat_plain=False)  # spell 2
    assert [gate.begin(), gate.begin(), gate.begin()] == [IDLE, IDLE, PROBE]
    gate.probed(pays_now=False, beat_plain=False)  # spell 4
    assert [gate.begin() for _ in range(5)] == [IDLE] * 4 + [PROBE]
    gate.probed(pays_now=False, beat_plain=False)  # 8, capped at 4
    assert [gate.begin() for _ in range(5)] == [IDLE] * 4 + [PROBE]
    gate.probed(pays_now=False, beat_plain=True)  # acceptance coming back: halved
    assert [gate.begin() for _ in range(3)] == [IDLE] * 2 + [PROBE]
    gate.probed(pays_now=True, beat_plain=False)
    assert gate.begin() == DRAFT and gate.idle_iterations == 1 + 2 + 4 + 4 + 2
    gate.start_run()
    assert (gate.idle, gate.backoff, gate.idle_iterations) == (0, 0, 0)


@pytest.mark.parametrize("options, message", [
    ({"idle_slack": 1.0}, "--idle-slack must be in [0, 1), got 1.0"),
    ({"idle_slack": -0.1}, "--idle-slack must be in [0, 1)"),
    ({"backoff_max": 0}, "--backoff-max must be at least 1, got 0"),
])
def test_the_cost_aware_knobs_are_checked(options, message):
    from dynatree import DynaTreeError

    with pytest.raises(DynaTreeError) as info:
        make_config("dynatree", **options)
    assert message in str(info.value)


def test_idle_slack_sets_how_far_below_plain_steps_a_draft_may_stay():
    """The draft of the test above (four target steps per call: about a third of plain steps' rate)
    idles at the default slack of 5% and keeps drafting when told a drop of 90% is fine."""
    from dynatree.costmodel import CostCurve

    curve = CostCurve((1, 2, 8), (0.005, 0.0051, 0.006))
    for slack, idles in ((0.05, 1), (0.9, 0)):
        policy = dynatree(cost_aware=True, d0=1, d_max=2, history=False, idle_slack=slack)
        policy.prepare(curve, model_free=False)
        drafter = ScriptedDrafter(lambda path: [(100 + len(path), 0.95)])
        _step(policy, drafter, 1, curve, 0.02, bonus=101)  # its cost learnt
        assert draft(policy, drafter, 101, max_depth=10).n_drafted >= 1 and policy.gate.idle == idles, slack
