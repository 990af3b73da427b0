"""Compiled q4 one-token steps of the embedded target with each way inductor can call its kernels.

  python docs/results/cpp-wrapper/wrapper_step.py python     generated Python calls the kernels (before dc47605)
  python docs/results/cpp-wrapper/wrapper_step.py cpp        a C++ wrapper, compiled with the kernels
  python docs/results/cpp-wrapper/wrapper_step.py separate   a C++ wrapper, its entry compiled apart (shipped)

One process per setting (the choice is made when the graph is built): loads the model, builds the
one-token graph (`setup s`: load plus compile; set TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 for a cold
compile), runs 10 untimed steps, then prints the medians of 6 blocks of 40 steps (ms) and their
median, and saves the step's logits to /tmp/wrapper_logits_<setting>.pt to compare bit for bit.
Run the settings alternately on an otherwise idle machine. Context: CONTEXT (300) tokens, weights
WEIGHTS (q4; `WEIGHTS=dense` for float32), as in ../q4-step-profile/step.py, whose `setup` it uses.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "q4-step-profile"))
from dynatree import runtime  # noqa: E402

SETTINGS = {"python": {}, "cpp": {"cpp_wrapper": True},
            "separate": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}}

if __name__ == "__main__":
    setting = sys.argv[1]
    runtime.wrapper_options = lambda device: SETTINGS[setting]
    import step  # noqa: E402  (../q4-step-profile)

    torch.set_grad_enabled(False)
    start = time.time()
    run = step.setup()
    for _ in range(10):
        run()
    print("setup s", round(time.time() - start, 1))
    blocks = []
    for _ in range(6):
        times = []
        for _ in range(40):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        blocks.append(statistics.median(times) * 1e3)
    print(setting, [round(b, 2) for b in blocks], "median", round(statistics.median(blocks), 2))
    torch.save(run(), f"/tmp/wrapper_logits_{setting}.pt")
