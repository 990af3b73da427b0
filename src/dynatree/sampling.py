"""Sampling mode: the target distribution, and lossless verification of drafted trees.

The distribution every method samples from is the target's next-token distribution after
temperature, then top-k, then top-p (the order transformers applies them in `generate`):
top-k keeps tokens whose logit reaches the k-th largest; top-p keeps the most probable
tokens until their probability mass first exceeds top_p (at least one token).

Verification (`sample_accept`) is recursive rejection sampling over the children of each
node, starting at the root: with p the target's (residual) distribution at the node and
q the distribution a child was proposed from, the child is accepted with probability
min(1, p(x) / q(x)); on rejection p <- normalize(max(0, p - q)) and the next child is tried
(q renormalized without the rejected token); when every child is rejected, the bonus token
is sampled from what is left of p. This keeps the committed tokens distributed exactly as
sampling from the target, for two kinds of children:
  * sampled children (linear speculation: each chain token drawn from the draft's q): the
    classic speculative-sampling rule;
  * deterministic children (the top-B children of the tree policies): q is a point mass on
    the child, so a child is accepted with the residual probability p(x), i.e. the rule
    reduces to "sample from the target and descend into the child that matches".
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .config import cli_flag, option, require
from .errors import DynaTreeError
from .tree import Tree


@dataclass
class SamplingConfig:
    """How tokens are sampled when sampling is on (`--sample`)."""

    temperature: float = option(1.0, "softmax temperature (> 0)")
    top_k: int = option(0, "keep only the k most probable tokens (0: off)")
    top_p: float = option(1.0, "keep the smallest set of tokens whose probability exceeds top_p (1: off)")

    def validate(self) -> None:
        require(0 < self.temperature < math.inf, f"temperature (--temperature) must be > 0 and finite when sampling, got {self.temperature}")
        require(self.top_k >= 0, f"top_k (--top-k) must be >= 1 (or 0 for off), got {self.top_k}")
        require(0 < self.top_p <= 1, f"top_p (--top-p) must be in (0, 1], got {self.top_p}")


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[n, V] logits -> [n, V] float64 probabilities after temperature, top-k and top-p."""
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        fast = _top_k_probs(logits, cfg)
        if fast is not None:
            return fast
    scores = logits.double() / cfg.temperature
    if cfg.top_k and cfg.top_k < scores.shape[-1]:
        kth = scores.topk(cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_p, dtype=torch.bool).scatter(-1, order, _outside_nucleus(sorted_p, cfg.top_p))
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _outside_nucleus(sorted_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """For probabilities sorted most probable first: True where top-p drops the token (the
    mass of the more likely tokens already reaches top_p; the first token always stays)."""
    drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
    drop[..., 0] = False
    return drop


def _top_k_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor | None:
    """`target_probs` computed on the k largest logits only (then scattered back): the same
    result without sorting the whole vocabulary. None when a tie at the k-th logit would make
    top-k keep more than k tokens (the full computation handles that)."""
    k = cfg.top_k
    top = logits.double().topk(k + 1, dim=-1)  # sorted, most probable first
    if bool((top.values[..., k] == top.values[..., k - 1]).any()):
        return None
    probs = torch.softmax(top.values[..., :k] / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        probs = probs.masked_fill(_outside_nucleus(probs, cfg.top_p), 0.0)  # already sorted by topk
        probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    return out.scatter_(-1, top.indices[..., :k], probs)


class Sampler:
    """A sampling config with its seeded random generator: what the engine needs to sample."""

    def __init__(self, config: SamplingConfig, seed: int = 0):
        config.validate()
        self.config = config
        self.generator = torch.Generator().manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return target_probs(logits, self.config)

    def draw(self, probs: torch.Tensor) -> int:
        return sample(probs, self.generator)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def draw_without_replacement(weights: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """min(k, nonzero) distinct indices of a 1-D weight vector, distributed as k successive draws
    without replacement (each in proportion to the weights not yet drawn), in the order drawn.

    One pass instead of k renormalised draws over the whole vector: the indices of the k largest
    w_i / E_i, E_i ~ Exp(1) independent, sorted largest first, are exactly such a sequence of draws
    (the exponential form of the Gumbel-top-k trick). Only nonzero weights take part.
    """
    nonzero = (weights > 0).nonzero().squeeze(1)
    if len(nonzero) == 0 or k < 1:
        return []
    w = weights[nonzero].double().cpu()
    keys = w / torch.empty(len(w), dtype=torch.float64).exponential_(generator=generator)
    order = keys.topk(min(k, len(w))).indices  # sorted largest first: the order of the draws
    return nonzero[order].tolist()


def sample_accept(tree: Tree, probs: torch.Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """Accepted path and bonus token by recursive rejection sampling (see module doc).

    `probs` is [n, V]: the target distribution after each node. `tree.proposals[u]` is the
    [V] draft distribution u's children were sampled from; nodes without one have
    deterministic children.
    """
    probs = probs.cpu()
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(parent, []).append(node)
    tokens = tree.tokens.tolist()
    path, node = [], 0
    while True:
        p = probs[node].clone()
        q = tree.proposals.get(node)
        q = None if q is None else q.double().cpu().clone()
        accepted = None
        for child in children.get(node, []):
            x = tokens[child]
            q_child = torch.zeros_like(p)
            if q is None:
                q_child[x] = 1.0  # deterministic child: a point mass
            else:
                q_child = q / q.sum()
            ratio = float(p[x] / q_child[x]) if q_child[x] > 0 else 0.0
            if torch.rand((), generator=generator, dtype=torch.float64) < min(1.0, ratio):
                accepted = child
                break
            residual = torch.clamp(p - q_child, min=0.0)
            if float(residual.sum()) > 0.0:  # zero only by rounding: then p(x) >= q(x) and x was accepted
                p = residual / residual.sum()
            if q is not None:
                q[x] = 0.0  # the next child was drawn without replacement: q without x
        if accepted is None:
            return path, sample(p, generator)
        path.append(accepted)
        node = accepted


def sampling_config(sample: bool, temperature=None, top_k=None, top_p=None) -> SamplingConfig | None:
    """The validated sampling settings, or None for greedy decoding."""
    if not sample:
        given = [f"{n} ({cli_flag(n)})" for n, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                 if v is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise DynaTreeError(f"{', '.join(given)} {verb} only with sample=True (--sample); greedy decoding otherwise")
        return None
    for name, value, kind in (("temperature", temperature, "a number"), ("top_k", top_k, "an integer"),
                              ("top_p", top_p, "a number")):
        integral = isinstance(value, numbers.Integral)
        if value is not None and (isinstance(value, bool) or not (integral if kind == "an integer"
                                                                  else isinstance(value, numbers.Real))):
            raise DynaTreeError(f"{name} ({cli_flag(name)}) must be {kind}, got {value!r}")
    if top_k is not None and top_k < 1:
        raise DynaTreeError(f"top_k (--top-k) must be at least 1, got {top_k} (leave it out to disable top-k)")
    config = SamplingConfig(
        temperature=1.0 if temperature is None else float(temperature),
        top_k=0 if top_k is None else int(top_k),
        top_p=1.0 if top_p is None else float(top_p),
    )
    config.validate()
    return config
