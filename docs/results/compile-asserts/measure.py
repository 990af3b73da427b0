import sys, statistics, torch
import dynatree.runtime as rt
if sys.argv[1] == "on":
    rt.no_runtime_asserts = lambda: {}
from dynatree.models import load_model
from dynatree.api import generate
t = load_model("smollm2-135m", weights=sys.argv[2], compile=True)
prompt = (t.tokenizer("The history of the printing press begins", add_special_tokens=False).input_ids * 40)[:300]
generate(prompt_ids=prompt, method="ar", target=t, max_new_tokens=64, ignore_eos=True)
tp = []
for _ in range(7):
    r = generate(prompt_ids=prompt, method="ar", target=t, max_new_tokens=128, ignore_eos=True)
    tp.append(r.stats.tpot_s * 1e3)
print(sys.argv[2], sys.argv[1], "tpot ms median", f"{statistics.median(tp):.2f}", [f"{x:.2f}" for x in tp])
