"""Time dynamo's guard check of the compiled q4 one-token step (300-token context), by guard filter.

  FILTER=shipped|no-weights|previous|none python docs/results/guard-check/check.py

`shipped`: runtime.module_guards; `no-weights`: the same without the weights' TENSOR_MATCH guards (as
shipped until stop 59); `previous`: the filter before the modules' own dicts were dropped
(SKIPPED_MODULE_GUARDS only); `none`: dynamo's full guards. Prints how many guards the filter keeps
and the median microseconds of 2000 calls of the cache entry's guard check on the step's own inputs.
(README.md beside this file.)
"""
import os
import runpy
import statistics
import time

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import dynatree.runtime as runtime
from dynatree.runtime import cache_kwarg

FILTER = os.environ.get("FILTER", "shipped")
shipped = runtime.module_guards


def chosen(entries):
    if FILTER == "shipped":
        keep = shipped(entries)
    elif FILTER == "no-weights":  # shipped until stop 59: the weights' shapes and strides dropped too
        keep = [k and not (e.orig_guard.source.is_unspecialized_nn_module() and e.guard_type == "TENSOR_MATCH")
                for k, e in zip(shipped(entries), entries)]
    elif FILTER == "previous":
        skipped = runtime.SKIPPED_MODULE_GUARDS | {"TENSOR_MATCH"}  # as it then was
        keep = [not (e.orig_guard.source.is_unspecialized_nn_module() and e.guard_type in skipped) for e in entries]
    else:
        keep = [True] * len(entries)
    print(f"{FILTER}: {sum(keep)} of {len(entries)} guards kept")
    return keep


runtime.module_guards = chosen
torch.set_grad_enabled(False)
here = os.path.dirname(os.path.abspath(__file__))
step = runpy.run_path(os.path.join(here, "..", "q4-step-profile", "step.py"))["setup"]()
step()
cells = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
cache, target, ids = cells["cache"], cells["target"], cells["ids"]

# the frame dynamo guards: transformers' wrapper around the model's forward (its locals: args, kwargs, closure)
forward = type(target.model).forward
while forward.__code__.co_name != "wrapped_func":
    forward = forward.__wrapped__
frame = {"args": (target.model,),
         "kwargs": {"input_ids": torch.tensor([[ids[-1]]]), "position_ids": torch.tensor([[len(ids) - 1]]),
                    "attention_mask": None, cache_kwarg(target.model): cache, "use_cache": True}}
frame.update(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__)))
entries = _debug_get_cache_entry_list(forward.__code__)
guards = entries[0].guard_manager
assert guards.check(frame), guards.check_verbose(frame)
times = []
for _ in range(2000):
    start = time.perf_counter()
    guards.check(frame)
    times.append(time.perf_counter() - start)
print(f"{FILTER}: guard check {statistics.median(times) * 1e6:.0f} us (median of 2000)")
