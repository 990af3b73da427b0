"""Compiled q4 one-token steps of the embedded target at a 300-token context (issue 32).

  python docs/results/q4-step-profile/step.py guards    time steps with and without skip_guard_eval_unsafe
  python docs/results/q4-step-profile/step.py profile   torch.profiler table of 50 steps (guards skipped)
"""
import statistics
import sys
import time

import torch

from dynatree import cache as kv
from dynatree.models import load_model

CONTEXT = 300


def setup():
    torch.manual_seed(0)
    target = load_model("smollm2-135m", device="cpu", weights="q4", compile=True)
    target.warm_up(["token"])
    ids = [int(x) for x in torch.randint(100, 40000, (CONTEXT,))]
    cache = kv.new_cache(target.model)
    target.forward(cache, ids[:-1], list(range(CONTEXT - 1)), None, last_only=True)

    def step():  # one token on top of the prompt, then the cache back to the prompt
        logits = target.forward(cache, [ids[-1]], [CONTEXT - 1], None, compiled=True)
        kv.crop(cache, CONTEXT - 1)
        return logits
    return step


def guards(step):
    def block(n, unsafe):
        times = []
        with torch.compiler.set_stance(skip_guard_eval_unsafe=unsafe):
            for _ in range(n):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    checked = step()
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        print("same logits:", torch.equal(checked, step()))
    res = {False: [], True: []}
    for _ in range(6):  # interleaved blocks
        for unsafe in res:
            res[unsafe].append(block(40, unsafe))
    for unsafe, medians in res.items():
        print("skipped" if unsafe else "checked", [f"{m:.2f}" for m in medians],
              f"median {statistics.median(medians):.2f} ms")


def profile(step):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(10):
        step()
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True), torch_profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(50):
            step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    with torch.no_grad():
        {"guards": guards, "profile": profile}[sys.argv[1] if len(sys.argv) > 1 else "guards"](setup())
