"""Shared test helpers: tiny randomly initialised models built from configs (no downloads), the
reference decoders, the size of hypothesis searches, and what several test modules share (plain
decoding's cache, a scripted drafter, the chi-square test, the exactness tests' drafters and
method options).

Three architectures (GPT-NeoX as in Pythia, Llama, GPT-2) share a 96-token word-level
tokenizer, so any of them can draft for any other. Float64 by default, so that
floating-point near-ties cannot excuse a mismatch in the exactness tests.
"""

from __future__ import annotations

import copy
import functools
import os

import torch
from hypothesis import strategies as st
from scipy.stats import chi2
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, PreTrainedTokenizerFast

from dynatree import cache as kv
from dynatree.attention import stock_attention, use_gqa_attention
from dynatree.drafters import FeatureDrafter, HybridDrafter, LMDrafter, NgramDrafter
from dynatree.drafters.base import Proposal
from dynatree.featurehead import FeatureHead, HeadConfig, tokenizer_fingerprint
from dynatree.kernels import repack_linears, stock_linears, use_packed_linears
from dynatree.runtime import LoadedModel, cache_kwarg
from dynatree.sampling import SamplingConfig
from dynatree.tree import TreeBuilder, additive_mask

VOCAB = 96
EOS = 2
ARCHS = ("gpt_neox", "llama", "gpt2")
# Where the tests' tiny models live: the CPU (CI, `make test`), or a GPU when a run sets
# DYNATREE_TEST_DEVICE=cuda (docs/results/gpu: the engine's CUDA path has no other test).
DEVICE = torch.device(os.environ.get("DYNATREE_TEST_DEVICE", "cpu"))
ON_CPU = DEVICE.type == "cpu"  # oneDNN's packed linears (kernels.py) exist on the CPU only


@functools.cache
def tokenizer(vocab: int = VOCAB):
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def config(arch: str, vocab: int = VOCAB, context: int = 512):
    # initializer_range 0.3 (not 0.02) makes attention sharp, so logits depend strongly on
    # positions and context: a wrong position id or a wrong mask changes the argmax.
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=EOS, pad_token_id=0, initializer_range=0.3)
    if arch == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=context, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=context, rotary_pct=0.5, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=context, **common)
    raise ValueError(arch)


@functools.cache
def _model(arch: str, seed: int, dtype: torch.dtype, vocab: int, context: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(arch, vocab, context)).to(dtype).eval().to(DEVICE)
    use_gqa_attention(model)  # as load_model does: the Llama (grouped KV heads) runs attention.GQA_SDPA
    use_packed_linears(model)  # as load_model does: float32 linears run oneDNN on packed weights
    return model


def tiny(arch: str = "llama", seed: int = 0, dtype=torch.float64, vocab: int = VOCAB, context: int = 512,
         name: str | None = None, eos_ids=(EOS,)) -> LoadedModel:
    """A tiny random causal LM wrapped like a loaded model (shared per arguments; do not mutate)."""
    return LoadedModel(model=_model(arch, seed, dtype, vocab, context), tokenizer=tokenizer(vocab),
                       name=name or f"tiny-{arch}-{seed}", eos_ids=list(eos_ids))


@functools.cache
@torch.no_grad()
def add_noise(model, noise: float, seed: int) -> None:
    """Gaussian noise on every weight, `noise` times each tensor's own spread (from generator `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(noise * p.std() * torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device))


def noisy_copy(arch: str, seed: int, noise: float, dtype=torch.float64) -> LoadedModel:
    """The target's weights plus Gaussian noise: a draft that agrees often, but not always."""
    model = copy.deepcopy(_model(arch, seed, dtype, VOCAB, 512))
    add_noise(model, noise, 1000 + seed)
    repack_linears(model)
    return LoadedModel(model=model, tokenizer=tokenizer(), name=f"noisy-{arch}-{seed}-{noise}", eos_ids=[EOS])


@functools.cache
def tiny_head(arch: str = "llama", seed: int = 0, dtype=torch.float64, draft_vocab: int = 80) -> FeatureHead:
    """A random feature head for tiny(arch): proposes from `draft_vocab` ids of the 96 (shuffled, so
    the sub-vocabulary's row order differs from the target's), sharp enough to prefer some tokens."""
    return random_head(tiny(arch).name, f"head-{arch}-{seed}", 500 + seed, draft_vocab=draft_vocab, dtype=dtype)


@functools.cache
def fitted_head(arch: str = "llama") -> FeatureHead:
    """A feature head for tiny(arch) fitted to the target's own greedy text from a few prompts (teacher
    forcing: the target's features of a plain pass in, its next pick as the label), so that its drafts
    are often accepted and tests see accepted paths and their hidden-state hand-off, not only
    rejections (a random head gets next to nothing accepted). Deterministic: same seed, same steps."""
    target = tiny(arch)
    head = random_head(target.name, f"fitted-{arch}", 900, dtype=torch.float64)
    embed, rows = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight.detach()
    column = torch.full((rows.shape[0],), -1, dtype=torch.long, device=DEVICE)
    column[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=DEVICE)
    batches = []
    with torch.no_grad():
        for prompt in FITTED_PROMPTS:
            seq = torch.tensor([prompt + hf_greedy(target, prompt, 48)], device=DEVICE)
            out = target.model(seq, attention_mask=torch.ones_like(seq), output_hidden_states=True)
            labels = column[out.logits[0, 1:].argmax(-1)]  # the target's pick after positions 1.., as head rows
            batches.append((embed(seq[:, 1:]), out.hidden_states[-1][:, :-1], torch.arange(1, seq.shape[1])[None],
                            labels))
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)  # (deterministic: no dropout, no sampling)
    out_rows = rows[head.vocab_ids].to(torch.float64)
    with torch.enable_grad():
        for _ in range(FITTED_STEPS):
            for embeds, features, positions, labels in batches:
                keep = labels >= 0
                logits = head(embeds, features, positions.to(DEVICE))[0][keep] @ out_rows.T
                loss = torch.nn.functional.cross_entropy(logits, labels[keep])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return head.eval().requires_grad_(False)


FITTED_PROMPTS = [[5, 6, 7, 5, 6, 7, 30, 31], [5, 9, 11, 5, 9, 11, 5, 30], [7, 8, 9, 7, 8], [3, 4, 5, 6], [40, 41, 40, 41],
                  [9, 9, 9], [5, 30, 9]]
FITTED_STEPS = 60


def random_head(target: str, name: str, seed: int, hidden: int = 32, rows: int = VOCAB, draft_vocab: int = 80,
                dtype=torch.float64, context: int = 512) -> FeatureHead:
    """A random feature head (4 heads, 2 KV heads, FFN 64) for a tiny target named `target` of `hidden`
    width and `rows` output rows on the shared tokenizer, proposing `draft_vocab` shuffled ids, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    cfg = HeadConfig(target=target, hidden_size=hidden, vocab_size=rows, tokenizer_sha1=tokenizer_fingerprint(tokenizer()),
                     draft_vocab=draft_vocab, heads=4, kv_heads=2, ffn=64, context=context)
    head = FeatureHead(cfg, torch.randperm(rows, generator=gen)[:draft_vocab], name=name)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return head.to(dtype).eval().to(DEVICE)


@torch.no_grad()
def hf_greedy(target: LoadedModel, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Reference: transformers' own greedy generate(), with the attention transformers ships."""
    with stock_attention(target.model), stock_linears(target.model):
        out = target.model.generate(
            torch.tensor([prompt], device=target.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=target.device), do_sample=False,
            max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def fresh(arch: str, dtype=torch.float32):
    """A tiny model exactly as transformers builds it: no attention or kernel switch."""
    torch.manual_seed(11)
    return AutoModelForCausalLM.from_config(config(arch)).to(dtype).eval()


@torch.no_grad()
def steps(model) -> list[torch.Tensor]:
    """Logits of a prefill (no mask: causal), a one-token step and a masked 5-token tree step."""
    loaded = LoadedModel(model=model, tokenizer=tokenizer(), name="x")  # for its forward()
    cache = kv.new_cache(model)
    prompt = [5, 9, 14, 9, 5, 9, 14, 30, 31, 7]
    out = [loaded.forward(cache, prompt, list(range(10)), None)]
    out.append(loaded.forward(cache, [8], [10], None))
    # a hand-drawn tree below the 11 cached tokens: root 0 -> 1, 2; 1 -> 3; 2 -> 4
    parents = [-1, 0, 0, 1, 2]
    allowed = torch.zeros(5, 16, dtype=torch.bool)
    allowed[:, :11] = True
    for i, p in enumerate(parents):
        allowed[i, 11 + i] = True
        while p >= 0:
            allowed[i, 11 + p] = True
            p = parents[p]
    depth = [0, 1, 1, 2, 2]
    out.append(loaded.forward(cache, [3, 4, 5, 6, 7], [11 + d for d in depth], additive_mask(allowed, model.dtype, "cpu")))
    return out


# Test profile: "full" (the default; `make test` and CI) or "dev" (`make test-fast`): hypothesis
# searches a tenth as many examples there, and the slow-marked tests are deselected.
PROFILE = os.environ.get("DYNATREE_TEST_PROFILE", "full")
if PROFILE not in ("full", "dev"):
    raise RuntimeError(f"DYNATREE_TEST_PROFILE must be 'full' or 'dev', got {PROFILE!r}")


def examples(n: int) -> int:
    """How many examples a hypothesis search of `n` examples (full profile) runs in this profile."""
    return n if PROFILE == "full" else max(10, n // 10)


# ---- shared by several test modules ------------------------------------------------------

SAMPLING = SamplingConfig(temperature=0.9, top_k=5, top_p=0.97)  # the sampling tests' warps


def plain_cache(model, tokens: list[int]):
    """Cache of plain decoding: the tokens fed one at a time, positions 0..n-1."""
    cache = kv.new_cache(model)
    for pos, token in enumerate(tokens):
        model(input_ids=torch.tensor([[token]], device=model.device), position_ids=torch.tensor([[pos]], device=model.device),
              **{cache_kwarg(model): cache},
              use_cache=True)
    return cache


def assert_same_cache(actual, expected, tol: float = 1e-9):
    assert kv.length(actual) == kv.length(expected)
    for a, e in zip(actual.layers, expected.layers):
        torch.testing.assert_close(a.keys, e.keys, rtol=tol, atol=tol)
        torch.testing.assert_close(a.values, e.values, rtol=tol, atol=tol)


class ScriptedDrafter:
    """Answers with `script(path_tokens)` -> [(token, prob), ...]; records each call's nodes."""

    name = "scripted"

    def __init__(self, script):
        self.script = script
        self.calls: list[list[int]] = []

    def propose(self, tree: TreeBuilder, nodes, k, full=False):
        self.calls.append(list(nodes))
        ids = torch.full((len(nodes), k), -1)
        probs = torch.zeros(len(nodes), k, dtype=torch.float64)
        for row, node in enumerate(nodes):
            for col, (tok, p) in enumerate(self.script(tree.path_tokens(node))[:k]):
                ids[row, col], probs[row, col] = tok, p
        return Proposal(ids, probs, forwards=1)  # as a draft model: every call is a forward

    def without_model(self):
        return None

    def warm_up(self):
        return 0.0  # nothing compiled


def chi_square_pvalue(counts: dict, expected: dict[tuple, float], n: int) -> float:
    """Goodness of fit; cells expecting fewer than 5 samples are pooled into one. An outcome the
    distribution forbids (probability 0, or not listed) gives 0: pooled, it would only dilute."""
    if any(count and expected.get(cell, 0.0) <= 0.0 for cell, count in counts.items()):
        return 0.0
    observed, expect, pooled_o, pooled_e = [], [], 0, 0.0
    for cell, p in expected.items():
        if p * n >= 5:
            observed.append(counts.get(cell, 0))
            expect.append(p * n)
        else:
            pooled_o += counts.get(cell, 0)
            pooled_e += p * n
    observed.append(pooled_o + sum(c for cell, c in counts.items() if cell not in expected))
    expect.append(pooled_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expect) if e > 0)
    return float(chi2.sf(stat, df=len(observed) - 1))


@functools.cache
def tiny_store(arch: str):
    """A datastore of the tiny target's own greedy text (continuations of short motifs), as
    `dynatree distill --kind store` would build from its answers: often right, sometimes not."""
    from dynatree.datastore import from_answers

    target = tiny(arch)
    prompts = [[5 + i, 6 + 2 * i, 5 + i] for i in range(12)] + [[40, 41, 40, 41], [9, 9, 9]]
    return from_answers(target, [(p + hf_greedy(target, p, 20), len(p)) for p in prompts], name=f"tiny-store-{arch}")


def make_drafter(kind: str, arch: str):
    target = tiny(arch)
    if kind == "ngram":
        return NgramDrafter(max_n=3)
    if kind == "store":  # the n-gram drafter backed by a datastore of the target's own text
        return NgramDrafter(max_n=3, vocab_size=target.vocab_size, store=tiny_store(arch))
    if kind == "hybrid-store":
        return HybridDrafter(NgramDrafter(max_n=3, store=tiny_store(arch)),
                             LMDrafter(noisy_copy(arch, 0, 0.08), target.vocab_size))
    if kind == "feature":  # a random feature head fed the target's hidden states (sub-vocabulary of 80 ids)
        return FeatureDrafter(tiny_head(arch), target)
    if kind == "hybrid":  # n-gram where the context repeats (order >= 2), the noisy copy elsewhere
        return HybridDrafter(NgramDrafter(max_n=3), LMDrafter(noisy_copy(arch, 0, 0.08), target.vocab_size))
    draft = {"self": target, "noisy": noisy_copy(arch, 0, 0.08), "other": tiny("gpt2" if arch != "gpt2" else "llama", seed=7)}[kind]
    return LMDrafter(draft, vocab_limit=target.vocab_size)


def method_options(draw, method: str) -> dict:
    if method == "linear":
        return {"k": draw(st.integers(1, 8))}
    if method == "fixed-tree":
        return {"depth": draw(st.integers(1, 6)), "branch": draw(st.integers(1, 4)),
                "tau": draw(st.sampled_from([0.0, 0.001, 0.05, 0.3])), "n_max": draw(st.sampled_from([1, 2, 3, 7, 20, 256]))}
    if method == "dynatree":
        d_max = draw(st.integers(2, 8))
        b = sorted(draw(st.lists(st.integers(1, 4), min_size=3, max_size=3)))
        tau_l = draw(st.sampled_from([0.05, 0.2, 0.4]))
        rho_stop = draw(st.sampled_from([0.001, 0.01, 0.1]))
        return {"d0": draw(st.integers(1, d_max - 1)), "d_max": d_max, "b_min": b[0], "b_mid": b[1], "b_max": b[2],
                "tau_l": tau_l, "tau_h": draw(st.sampled_from([tau_l + 0.05, 0.6, 0.9])),
                "rho_stop": rho_stop, "rho_deep": draw(st.sampled_from([rho_stop * 2, 0.3, 0.8])),
                "tau": draw(st.sampled_from([0.0, 0.001, 0.05])), "n_max": draw(st.sampled_from([1, 2, 5, 16, 256])),
                "history": draw(st.booleans()), "history_window": draw(st.integers(1, 6)),
                "target_accept": draw(st.sampled_from([0.1, 0.5, 0.9])), "eta_depth": draw(st.sampled_from([0.0, 3.0, 20.0])),
                "cost_aware": draw(st.booleans())}
    if method == "wetap":
        w_min = draw(st.integers(1, 4))
        return {"depth": draw(st.integers(1, 6)), "budget": draw(st.sampled_from([1, 2, 5, 16, 64])),
                "w_min": w_min, "w_max": w_min + draw(st.integers(0, 6)), "gamma": draw(st.sampled_from([0.5, 1.2, 4.0])),
                "alpha": draw(st.sampled_from([0.0, 0.6, 1.0])), "dynamic_width": draw(st.booleans()),
                "verify": draw(st.sampled_from(["beam", "exact"])), "beam_tau": draw(st.sampled_from([0.0, 0.5, 0.9]))}
    if method == "specinfer":
        return {"width": draw(st.integers(1, 4)), "depth": draw(st.integers(1, 6))}
    if method == "specexec":
        return {"budget": draw(st.sampled_from([1, 2, 5, 16, 40])), "depth": draw(st.integers(1, 6)),
                "expand": draw(st.integers(1, 4)), "branch": draw(st.integers(1, 4))}
    if method == "opt-tree":
        return {"budget": draw(st.sampled_from([1, 2, 5, 16, 40])), "depth": draw(st.integers(1, 6)),
                "delta": draw(st.sampled_from([0.0, 0.05, 0.5]))}
    if method == "dsbd":
        return {"width": draw(st.integers(1, 5)), "depth": draw(st.integers(1, 6))}
    if method == "mtad":
        return {"width": draw(st.integers(1, 5)), "depth": draw(st.integers(1, 6)),
                "joint_tau": draw(st.sampled_from([0.0, 0.5, 0.99]))}
    return {}
