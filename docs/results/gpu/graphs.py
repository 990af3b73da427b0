"""Why a compiled run on CUDA builds a third graph (tests/test_compile.py's bounded-graphs test failed on the
H200 for two of its six cases): the test's runs, with the graph count after each and the recompile reasons
(run with TORCH_LOGS=recompiles). Device from DYNATREE_TEST_DEVICE, as the tests."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from helpers import tiny  # noqa: E402

from dynatree import api, runtime  # noqa: E402
from dynatree.models import LoadedModel  # noqa: E402

CASES = [("dynatree", {}, None), ("dynatree", {"cost_aware": True}, None), ("fixed-tree", {}, "4,24"),
         ("dynatree", {}, "4,24")]
for method, options, window in CASES:
    base = tiny("llama", seed=4, dtype=torch.float32)
    target = LoadedModel(model=base.model, tokenizer=base.tokenizer, name="tiny-bounded", eos_ids=[])
    torch._dynamo.reset()
    prompt = [5, 9, 14, 9, 5, 9, 14, 30, 7, 5, 9]
    before = runtime.compiled_graphs()
    print(f"=== {method} {options} window={window}", flush=True)
    for attempt in (1, 2):
        r = api.generate(method=method, target=target, draft="ngram", prompt_ids=prompt, max_new_tokens=30,
                         ignore_eos=True, compile=True, kv_window=window, **options)
        print(f"run {attempt}: graphs {runtime.compiled_graphs() - before} compile_s {r.stats.compile_s:.1f} "
              f"while timed {r.stats.graphs_compiled_while_timed} L {r.stats.tokens_per_iter:.2f} "
              f"tokens {r.new_token_ids[:12]}", flush=True)
