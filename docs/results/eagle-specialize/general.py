"""General-chat check of feature heads (docs/results/eagle-specialize): top-1 agreement per depth on
the first chunk of the self-written questions' committed answers (64 conversations the target wrote
from topic seeds, answered greedily in float32; `--self-prompts 64`), labelled by the float32 target.

These conversations are in the shipped head's training data (all but its 2% split), so its figure
here is a training fit, not a held-out score: the point is only to see whether a head trained further
on other data forgets them (a fall here is forgetting; parity is not evidence of generalization).

    python docs/results/eagle-specialize/general.py smollm2-135m-eagle /work/runs/spec/specialized > general.json
"""

import json
import sys
import time
from pathlib import Path

import torch

from dynatree.distill.eagle_data import EagleConfig, build_data
from dynatree.distill.eagle_train import evaluate, vocab_tables
from dynatree.embedded import EMBEDDED_DRAFTS
from dynatree.featurehead import check_head, load_head
from dynatree.models import DEFAULT_TARGET, load_model

DATA_DIR = Path(__file__).resolve().parents[3] / "data" / "distill" / "smollm2-135m"

target = load_model(DEFAULT_TARGET)
cfg = EagleConfig(prompts="", holdout=0, self_prompts=64, self_documents=0, data_dir=str(DATA_DIR), unroll=3)
t0 = time.perf_counter()
data = build_data(target, cfg, progress=True, parts=DATA_DIR)
result = {"target": DEFAULT_TARGET, "conversations": len(data["tokens"]), "source": "--self-prompts 64 (first chunk)",
          "answer_tokens": sum(len(t) - s for t, s in zip(data["tokens"], data["answer_from"])),
          "build_s": time.perf_counter() - t0, "heads": {}}
embed = target.model.get_input_embeddings()
for spec in sys.argv[1:]:
    head = load_head(EMBEDDED_DRAFTS.get(spec, Path(spec)))
    check_head(head, target)
    vocab = head.vocab_ids
    sub_index, out_rows = vocab_tables(target, vocab)
    with torch.no_grad():
        result["heads"][spec] = evaluate(head, embed, out_rows, data, list(range(len(data["tokens"]))), cfg,
                                         sub_index, vocab)
json.dump(result, sys.stdout, indent=1)
print()
