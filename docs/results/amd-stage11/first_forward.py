# The cost-aware policy's learnt draft-forward cost after each of the first iterations (issue 28; amd-stage11/README.md).
# Usage: python first_forward.py SRC COMPILE [DRAFT]   (SRC: a checkout's src directory, e.g. one at 1236132 for
# "before" and at beedfef or later for "after"; COMPILE 0 or 1). Three Spec-Bench questions (the second of the
# summarization, rag and writing tasks), chat template, 64 new tokens, float32, dynatree --cost-aware.
import json, os, sys
sys.path.insert(0, sys.argv[1])
import dynatree
from dynatree import api
print(dynatree.__file__)
qs = [json.loads(l) for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../shared/data/spec_bench/question.jsonl"))]
compile = sys.argv[2] == "1"
draft = sys.argv[3] if len(sys.argv) > 3 else "smollm2-135m-eagle"
for cat in ("summarization", "rag", "writing"):
    q = [x for x in qs if x["category"] == cat][1]
    req = api.build_request("probe", [{"role": "user", "content": q["turns"][0]}], "dynatree", {"cost_aware": True},
                            draft=draft, chat=True, max_new_tokens=64, weights="dense", compile=compile)
    job = api.prepare(req)
    dec = job.decoder()
    fwd = []
    for i, step in enumerate(dec.steps(job.prompt_ids, 64)):
        fwd.append(round(dec.policy.costs.forward_s * 1e3, 2))
    print(cat, len(job.prompt_ids), "forward_s ms after iterations 1..8:", fwd[:8], "idle", dec.policy.gate.idle_iterations, "of", len(fwd))
