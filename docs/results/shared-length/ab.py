"""Compiled q4 one-token steps of the embedded target on two caches, interleaved in one process:
the cache as shipped (one length shared by every layer, `cache.Filled`) and the cache before it (one
length per layer, each a symbolic input and a returned value of the graph), kept at OLD_CACHE (the
previous cache.py, imported as a module of its own). Same logits bit for bit?

  git show 1789664:src/dynatree/cache.py | sed 's/from \./from dynatree./' > /tmp/oldcache.py
  OLD_CACHE=/tmp/oldcache.py CONTEXT=300 python docs/results/shared-length/ab.py    (output: ab.txt)
"""
import importlib.util
import os
import statistics
import sys
import time

import torch

from dynatree import cache as kv
from dynatree.models import load_model

CONTEXT = int(os.environ.get("CONTEXT", "300"))
spec = importlib.util.spec_from_file_location("oldcache", os.environ["OLD_CACHE"])
old = importlib.util.module_from_spec(spec)
sys.modules["oldcache"] = old
spec.loader.exec_module(old)


def main():
    torch.manual_seed(0)
    target = load_model("smollm2-135m", device="cpu", weights="q4", compile=True)
    target.compiled()  # sets the dynamic sources; the old cache's per-layer lengths are added:
    torch.compiler.config.dynamic_sources += r",L\['kwargs'\]\['cache'\]\.layers\[\d+\]\.length"
    ids = [int(x) for x in torch.randint(100, 40000, (CONTEXT,))]
    steps = {}
    for name, make in (("per-layer lengths (before)", old.new_cache), ("shared length (shipped)", kv.new_cache)):
        cache = make(target.model)
        target.forward(cache, ids[:-1], list(range(CONTEXT - 1)), None, last_only=True)

        def step(cache=cache, crop=(old.crop if make is old.new_cache else kv.crop)):
            logits = target.forward(cache, [ids[-1]], [CONTEXT - 1], None, compiled=True)
            crop(cache, CONTEXT - 1)
            return logits
        for _ in range(3):
            step()
        steps[name] = step
    a, b = (f() for f in steps.values())
    print("same logits:", torch.equal(a, b), flush=True)
    times = {name: [] for name in steps}
    for _ in range(7):
        for name, f in steps.items():
            start = time.perf_counter()
            for _ in range(40):
                f()
            times[name].append((time.perf_counter() - start) / 40 * 1e3)
    for name, v in times.items():
        print(f"{name}: blocks {' '.join(f'{t:.2f}' for t in v)}  median {statistics.median(v):.2f} ms", flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
