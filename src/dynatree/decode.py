"""The speculative decoding loop: draft tree -> verify -> accept -> commit cache.

State between iterations: the committed tokens `seq`, and the target cache holding every
committed token but the last one (or, with a KV window, the ones the window still needs;
`slot_pos` gives each cache slot's position). The last token (the previous bonus) is the
root of the next tree, so it is fed together with the drafted nodes in the next
verification pass. The prefill runs the whole prompt and yields the first new token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from . import cache as kv
from .drafters.base import Drafter
from .runtime import LoadedModel, compiled_graphs
from .costmeasure import curve_for
from .policies.base import Growing, Timing, TreePolicy
from .result import TokenLogprob
from .stats import Clock, Stats
from .tree import Tree, causal_allowed
from .sampling import Sampler
from .verify import Accepted, default_verifier
from .window import KVWindow


@dataclass
class Step:
    """What one iteration did; yielded by `Decoder.steps` after the caches are committed."""

    tree: Tree  # the verified tree (root = previous last token)
    path: list[int]  # accepted drafted nodes, root excluded
    committed: list[int]  # tokens committed this iteration (path tokens + bonus, maybe truncated)


@dataclass
class Run:
    """State of one generation, visible to tests between iterations."""

    seq: list[int]  # prompt + committed new tokens
    prompt_len: int
    cache: object  # target KV cache: entries for seq[:-1] (those the KV window keeps, if any)
    slot_pos: torch.Tensor  # [cache length] long, position in `seq` of each cache slot
    stats: Stats = field(default_factory=Stats)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the decoder scores them

    @property
    def new_tokens(self) -> list[int]:
        return self.seq[self.prompt_len :]


class Decoder:
    """Decoding of one target with one tree policy (and the drafter it needs): greedy, or
    sampling with a `Sampler`; optionally under an attention-sink KV window."""

    def __init__(self, target: LoadedModel, policy: TreePolicy, drafter: Drafter | None = None,
                 window: KVWindow | None = None, sampler: Sampler | None = None, compile: bool | None = None,
                 logprobs: int | None = None):
        if policy.needs_drafter and drafter is None:
            raise ValueError("this policy needs a drafter")
        self.target = target
        self.policy = policy
        self.drafter = drafter
        # attention-sink KV window applied to the target; else, for a model whose every layer slides,
        # the window that evicts exactly the keys no later query can see (see `sliding_eviction`)
        self.window = window if window is not None else sliding_eviction(target)
        self.sampler = sampler  # sampling mode (lossless rejection sampling), or None for greedy
        self.compile = target.compile if compile is None else compile  # target steps through torch.compile
        self.verifier = policy.verifier or default_verifier(sampler)  # the policy's own rule (lossy), else ours
        self.logprobs = logprobs  # score every new token (with this many alternatives) from the logits at hand; None: not
        self._prepared, self._compile_s = False, 0.0  # `prepare` ran for the next run; what compiling took

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        ignore_eos: bool = False,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Run:
        for _ in self.steps(prompt_ids, max_new_tokens, ignore_eos, on_tokens):
            pass
        return self.run

    @torch.no_grad()
    def prepare(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """What a run needs before its clock starts: the compiled graphs (built if missing), the
        target's measured verification cost for a cost-aware policy (once per target), and the
        policy reset for a new sequence. `steps` calls it when the caller did not; a caller that
        measures the run itself (peak memory: `api.run`) calls it first, so that what it measures
        starts where the timings do."""
        hidden = self.drafter is not None and self.drafter.uses_target_hidden
        self._compile_s = self._warm_up(hidden) if max_new_tokens > 1 else 0.0
        curve = None  # the target's verification cost (seconds)
        if self.policy.uses_cost_curve:
            curve = curve_for(self.target, list(prompt_ids), masked_token=self._masked_tokens, compiled=self.compile)
        self.policy.prepare(curve, model_free=self.drafter is not None and self.drafter.without_model() is not None)
        self._prepared = True

    @torch.no_grad()
    def steps(self, prompt_ids, max_new_tokens, ignore_eos=False, on_tokens=None,
              stop: Callable[[], bool] | None = None) -> Iterator[Step]:
        """Generate, yielding after every verification (the prefill is not a `Step`). Closing the
        generator early ends the run there, with its stats complete up to that step. `stop`, asked
        before every iteration (after the prefill too), ends the run when it says so: a stop string
        that `on_tokens` saw completed, or a client gone."""
        device = self.target.device
        compiled = self.compile  # the setting of this whole run
        hidden = self.drafter is not None and self.drafter.uses_target_hidden  # hand the target's features over
        if not self._prepared:
            self.prepare(prompt_ids, max_new_tokens)
        self._prepared, compile_s = False, self._compile_s  # a later run prepares again
        graphs = compiled_graphs()
        clock = Clock(device)
        stop_ids = set() if ignore_eos else set(self.target.eos_ids)
        run = self.run = Run(seq=list(prompt_ids), prompt_len=len(prompt_ids),
                             cache=kv.new_cache(self.target.model), slot_pos=torch.empty(0, dtype=torch.long),
                             logprobs=None if self.logprobs is None else [])
        stats = run.stats
        stats.draft_s = stats.verify_s = stats.commit_s = 0.0
        self._prefill(run, hidden, clock, on_tokens)

        try:  # a consumer that stops early (a server cancelling) still gets the stats so far
            while stats.new_tokens < max_new_tokens and run.seq[-1] not in stop_ids and not (stop and stop()):
                remaining = max_new_tokens - stats.new_tokens
                cached = kv.length(run.cache)

                t_draft = time.perf_counter()
                tree = draft(self.policy, self.drafter, run.seq[-1], remaining - 1, self.sampler)  # 1. draft
                t_verify = time.perf_counter()
                positions = tree.position_ids(len(run.seq) - 1)[0]  # the root is seq[-1]
                logits, features = self._forward(run, tree.tokens.tolist(), positions, tree.allowed(cached), hidden=hidden)  # 2. verify
                accepted = self.verifier.accept(tree, logits, self.sampler)  # 3. accept (its host sync ends the verification)
                t_commit = time.perf_counter()
                committed = self._commit(run, tree, accepted, positions, features, cached, stop_ids, remaining)  # 4. commit
                t_done = time.perf_counter()

                self.policy.observe(tree, accepted.path, accepted.bonus, Timing(draft_s=t_verify - t_draft, verify_s=t_done - t_verify))
                stats.count_iteration(tree.n_drafted, min(len(accepted.path), len(committed)), len(committed),
                                      draft_s=t_verify - t_draft, verify_s=t_commit - t_verify, commit_s=t_done - t_commit)
                if run.logprobs is not None:  # each committed token scored by the row of the node before it (outside the policy's timings)
                    run.logprobs += token_logprobs(logits, [0] + accepted.path, committed, self.logprobs)
                if on_tokens:
                    on_tokens(committed)
                yield Step(tree=tree, path=accepted.path, committed=committed)
        finally:
            stats.wall_s = clock.elapsed()
            if compiled or compile_s > 0:  # (a drafter made to compile its own steps in an eager run too)
                stats.compile_s, stats.graphs_compiled_while_timed = compile_s, compiled_graphs() - graphs

    def _prefill(self, run: Run, hidden: bool, clock: Clock, on_tokens) -> None:
        """The whole prompt in one causal pass gives the first new token; the drafter starts from
        the prompt (and the target's features of it)."""
        prompt_pos = torch.arange(run.prompt_len)
        logits, features = self._forward(run, run.seq, prompt_pos, causal_allowed(0, run.prompt_len), prefill=True,
                                         hidden=hidden)
        run.slot_pos = prompt_pos
        first = int(logits[-1].argmax()) if self.sampler is None else self.sampler.draw(self.sampler.probs(logits[-1:])[0])
        run.seq.append(first)
        if run.logprobs is not None:
            run.logprobs += token_logprobs(logits[-1:], [0], [first], self.logprobs)
        run.stats.iterations, run.stats.new_tokens, run.stats.ttft_s = 1, 1, clock.elapsed()
        if on_tokens:
            on_tokens([first])
        self._evict(run)
        if self.drafter is not None:  # (the drafter's own prefill: drafting time, outside any tree's)
            start = clock.now()
            self.drafter.reset(run.seq, features)
            run.stats.draft_s += clock.now() - start  # (the clock waits for its device work: none left to the first tree)

    def _commit(self, run: Run, tree: Tree, accepted: Accepted, positions: torch.Tensor, features: torch.Tensor | None,
                cached: int, stop_ids: set[int], limit: int) -> list[int]:
        """Keep the root's and the accepted path's cache entries (the rest of the tree's are
        dropped), append the path's tokens and the bonus (cut after a stop token and at `limit`
        tokens) and hand the drafter the new sequence with the target's features of what it kept."""
        keep = torch.tensor([0] + accepted.path)
        kv.keep(run.cache, cached, keep)
        run.slot_pos = torch.cat([run.slot_pos, positions[keep]])
        committed = _truncate(tree.tokens[accepted.path].tolist() + [accepted.bonus], stop_ids, limit)
        run.seq.extend(committed)
        self._evict(run)
        if self.drafter is not None:
            self.drafter.commit(run.seq, tree.drafted_nodes(accepted.path), None if features is None else features[keep])
        return committed

    def _warm_up(self, hidden: bool) -> float:
        """Build the compiled graphs this run will use: the target's when the run compiles, the drafter's
        when it compiles its own steps (its `warm_up` is 0.0 otherwise); the seconds that took."""
        seconds = self.target.warm_up(self._step_kinds(), hidden) if self.compile else 0.0
        return seconds + (self.drafter.warm_up() if self.drafter is not None else 0.0)

    @property
    def _masked_tokens(self) -> bool:
        """One-token steps get an explicit mask: under a KV window (slots are not positions), and for
        sliding-window models, whose own mask for one query appears only once the context passes the
        window (a compiled graph built without it would be built again then, inside the timings)."""
        return self.window is not None or self.target.layout.window is not None

    def _step_kinds(self) -> set[str]:
        """The kinds of target step (runtime.STEP_KINDS) this run makes (the cost curve's sweep makes
        the same): one token, masked under a KV window; trees when there is a drafter."""
        kinds = {"masked-token" if self._masked_tokens else "token"}
        if self.policy.needs_drafter:
            kinds.add("tree")
        return kinds

    def _forward(self, run: Run, ids: list[int], positions: torch.Tensor, allowed: torch.Tensor,
                 prefill: bool = False, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logits for `ids` at `positions` (only the last row for the prefill), and with
        `hidden` the last hidden states of every row (else None).

        `allowed` [len(ids), cached + len(ids)] says what each query may see before the KV
        window (if any) removes what the window policy hides.
        """
        if self.window is not None:
            allowed = allowed & self.window.visible(positions, torch.cat([run.slot_pos, positions]))
        if prefill and self.window is None or len(ids) == 1 and not self._masked_tokens:
            mask = None  # plain causal attention by slot (sliding windows too): the model's own mask
        else:
            mask = self.target.masks(allowed, positions, torch.cat([run.slot_pos, positions]))
        out = self.target.forward(run.cache, ids, positions.tolist(), mask, last_only=prefill, hidden=hidden,
                                  compiled=self.compile)
        return out if hidden else (out, None)

    def _evict(self, run: Run) -> None:
        """Drop the cache slots the KV window no longer lets any future query see."""
        if self.window is None:
            return
        run.slot_pos = self.window.evict(run.cache, run.slot_pos, next_pos=len(run.seq) - 1)


def draft(policy: TreePolicy, drafter: Drafter | None, root_token: int, max_depth: int,
          sampler: Sampler | None = None) -> Tree:
    """Grow one tree below `root_token` with the policy's rules and the drafter's proposals."""
    return answer(policy.grow(root_token, max_depth, sampler), drafter)


def answer(growing: Growing, drafter: Drafter | None) -> Tree:
    """Run a policy's growth to its end, answering each `Ask` it yields with the drafter's proposal
    (from its model-free part when the ask says so); the tree it returns."""
    proposal = None
    while True:
        try:  # only the policy's own end stops this loop (a StopIteration from a drafter would not)
            ask = growing.send(proposal)
        except StopIteration as done:
            return done.value
        source = drafter.without_model() if ask.model_free and drafter is not None else drafter
        if source is None:
            raise ValueError("a tree policy asked for proposals without a drafter" if drafter is None else
                             f"a tree policy asked for the model-free part of {drafter.name}, which has none")
        proposal = source.propose(ask.tree, ask.nodes, ask.k, full=ask.full)


def sliding_eviction(target: LoadedModel) -> KVWindow | None:
    """For a model whose every layer attends through a window of W tokens (Mistral, Starcoder2), the
    KV window (no sinks, the W - 1 keys before each query) that is the same rule: a query at t sees
    t - W < k <= t. Applied to the cache it keeps W - 1 entries plus the tree, like transformers'
    rolling cache, instead of the whole sequence; the masks do not change. None for other models
    (a full-attention layer needs every entry)."""
    layout = target.layout
    if layout.window is None or layout.window < 2 or layout.layer_types is not None:  # full layers too
        return None
    return KVWindow(0, layout.window - 1)


def _truncate(tokens: list[int], stop_ids: set[int], limit: int) -> list[int]:
    """Cut after the first stop token and at `limit` tokens."""
    for i, token in enumerate(tokens[:limit]):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens[:limit]


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """`tokens[i]`'s log-probability in the target's distribution `logits[rows[i]]` (temperature 1,
    in float32 or the logits' wider dtype), with the `top` most likely tokens there."""
    rows = rows[:len(tokens)]  # (the committed group may be cut at a stop token or the length limit)
    dist = torch.log_softmax(logits[rows].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = dist.gather(1, torch.tensor(tokens, device=dist.device)[:, None])[:, 0].tolist()
    best = dist.topk(top, dim=-1) if top > 0 else None
    alternatives = [[] for _ in tokens] if best is None else [
        list(zip(ids, values)) for ids, values in zip(best.indices.tolist(), best.values.tolist())]
    return [TokenLogprob(token, value, alts) for token, value, alts in zip(tokens, chosen, alternatives)]
