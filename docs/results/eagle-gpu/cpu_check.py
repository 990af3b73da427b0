"""Are the GPU's greedy answers the target's answers on this CPU? Regenerates the answers of a few
turns from the GPU-built answers files (one at a time: no padding), greedy, float32, and reports how
many tokens each keeps in common with the GPU's answer before the first difference.
    python docs/results/eagle-gpu/cpu_check.py [N [LIST]] > docs/results/eagle-gpu/cpu_check.json
LIST: a file naming the answers files to sample from (one name a line), e.g. one lease's new files."""
import gzip
import json
import random
import sys
from pathlib import Path

from dynatree.distill.chat import generate_batched
from dynatree.models import load_model

n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
files = sorted(p for p in Path("data/distill/smollm2-135m").glob("answers-*.json.gz")
               if json.loads(gzip.decompress(p.read_bytes()))["device"].startswith("cuda"))
if len(sys.argv) > 2:
    wanted = set(Path(sys.argv[2]).read_text().split())
    files = [p for p in files if p.name in wanted]
rng = random.Random(0)
target = load_model("smollm2-135m", device="cpu", dtype="float32")
rows = []
for path in rng.sample(files, n):
    rec = json.loads(gzip.decompress(path.read_bytes()))
    i = rng.randrange(len(rec["sequences"]))
    seq, start = rec["sequences"][i], rec["answer_from"][i]
    gpu = seq[start:]
    cpu = generate_batched(target, [seq[:start]], 256, 1)[0]
    same = next((k for k, (a, b) in enumerate(zip(gpu, cpu)) if a != b), min(len(gpu), len(cpu)))
    rows.append({"file": path.name, "turn": i, "gpu_tokens": len(gpu), "cpu_tokens": len(cpu),
                 "common_prefix": same, "identical": gpu == cpu})
print(json.dumps({"turns": len(rows), "identical": sum(r["identical"] for r in rows),
                  "gpu_answer_tokens": sum(r["gpu_tokens"] for r in rows),
                  "tokens_before_first_difference": sum(r["common_prefix"] for r in rows), "rows": rows}, indent=1))
