"""Compiled q4 one-token steps of the embedded target at a 300-token context (issue 32).

  python docs/results/q4-step-profile/step.py guards    time steps with and without skip_guard_eval_unsafe
  python docs/results/q4-step-profile/step.py profile   torch.profiler table of 50 steps (guards skipped)
  python docs/results/q4-step-profile/step.py fusion    q, k, v (and gate, up) as one int4 product: same bits? time?
  python docs/results/q4-step-profile/step.py output    a Q8_0 output layer as two int4 products vs bfloat16, by rows
"""
import os
import statistics
import sys
import time

import torch

from dynatree import cache as kv
from dynatree.models import load_model

CONTEXT = int(os.environ.get("CONTEXT", "300"))  # prompt tokens before the timed step
# (WEIGHTS=dense: the float32 model instead of q4, for `setup`)


def setup():
    torch.manual_seed(0)
    target = load_model("smollm2-135m", device="cpu", weights=os.environ.get("WEIGHTS", "q4"), compile=True)
    target.warm_up(["token"])
    ids = [int(x) for x in torch.randint(100, 40000, (CONTEXT,))]
    cache = kv.new_cache(target.model)
    target.forward(cache, ids[:-1], list(range(CONTEXT - 1)), None, last_only=True)

    def step():  # one token on top of the prompt, then the cache back to the prompt
        logits = target.forward(cache, [ids[-1]], [CONTEXT - 1], None, compiled=True)
        kv.crop(cache, CONTEXT - 1)
        return logits
    return step


def interleaved(runs: dict, blocks: int, calls: int) -> dict:
    """Median ms per call of each function in `runs`, timed in `blocks` interleaved blocks of `calls` calls."""
    times = {name: [] for name in runs}
    for _ in range(blocks):
        for name, f in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                f()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


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


def fusion():
    """SmolLM2-135M's int4 products of one layer (q 576, k 192, v 192, gate 1536, up 1536, down 576 and
    o 576 outputs; random codes) as seven calls, or with q/k/v and gate/up concatenated (four calls),
    eager, bfloat16 activations: are the outputs the same bits, and what does a 30-layer step save?"""
    from dynatree.weights import Int4Linear

    torch.manual_seed(0)
    hidden, ffn = 576, 1536

    def parts(*outs, inp=hidden):
        return [(torch.randint(0, 16, (o, inp)), torch.rand(o, inp // 32) * 0.01, torch.randn(o, inp // 32) * 0.01)
                for o in outs]

    def layer(ps):
        return Int4Linear(*ps, None)

    def joined(ps):
        return Int4Linear(*(torch.cat([p[i] for p in ps]) for i in range(3)), None)

    qkv, gate_up = parts(576, 192, 192), parts(ffn, ffn)
    rest = [layer(parts(576, inp=ffn)[0]), layer(parts(576)[0])]  # down, o: one call each either way
    separate = [layer(p) for p in qkv] + [layer(p) for p in gate_up]
    fused = [joined(qkv), joined(gate_up)]
    for rows in (1, 2, 3, 5, 8, 16):
        x = torch.randn(rows, hidden).bfloat16()
        same = torch.equal(torch.cat([m(x) for m in separate[:3]], -1), fused[0](x)) and \
            torch.equal(torch.cat([m(x) for m in separate[3:]], -1), fused[1](x))
        print(f"{rows} rows: fused outputs {'equal' if same else 'DIFFER from'} the separate ones bit for bit")
    for rows in (1, 4):
        x, xd = torch.randn(rows, hidden).bfloat16(), torch.randn(rows, ffn).bfloat16()

        def step30(mods):
            for _ in range(30):
                for m in mods:
                    m(x)
                rest[0](xd)
                rest[1](x)
        times = interleaved({"7 calls": lambda: step30(separate), "4 calls": lambda: step30(fused)}, blocks=7, calls=1)
        print(f"{rows} rows, 30 layers: " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
    # compiled: the same products inside one torch.compile graph of 30 layers (each layer's outputs summed
    # into the next layer's input so nothing is dead code), one row
    layers = [([layer(p) for p in parts(576, 192, 192) + parts(ffn, ffn)], layer(parts(576, inp=ffn)[0]))
              for _ in range(30)]
    def chain(fused_groups: bool):
        def run(x):
            for i, (sep, down) in enumerate(layers):
                if fused_groups:
                    q, k, v = joined_layers[i][0](x).split([576, 192, 192], -1)
                    g, u = joined_layers[i][1](x).split([ffn, ffn], -1)
                else:
                    q, k, v, g, u = (m(x) for m in sep)
                x = x + down(torch.nn.functional.silu(g) * u) + q + torch.cat([k, v], -1).sum(-1, keepdim=True)
            return x
        return torch.compile(run)

    joined_layers = [(_rejoin(sep[:3]), _rejoin(sep[3:])) for sep, _ in layers]
    runs = {"7 calls": chain(False), "4 calls": chain(True)}
    x = torch.randn(1, hidden).bfloat16() * 0.01
    for f in runs.values():
        for _ in range(3):
            f(x)
    times = interleaved({k: (lambda f=f: f(x)) for k, f in runs.items()}, blocks=9, calls=20)
    print("1 row, 30 layers, compiled: " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))


def _rejoin(layers):
    """One Int4Linear computing `layers` side by side (their codes, scales and zeros concatenated), from
    each layer's own packed weights: codes recovered from the dequantized weight (exact: integers 0..15)."""
    from dynatree.weights import GROUP, Int4Linear

    codes, scales, zeros = [], [], []
    for m in layers:
        pairs = m.scales_and_zeros.float()  # (in / 32, out, 2)
        scale, zero = pairs[..., 0].t(), pairs[..., 1].t()  # (out, in / 32)
        w = m.dequantized()  # (out, in) = (q - 8) * scale + zero, per group of GROUP
        s, z = scale.repeat_interleave(GROUP, 1), zero.repeat_interleave(GROUP, 1)
        codes.append(((w - z) / s + 8).round().clamp(0, 15).to(torch.int32))
        scales.append(scale)
        zeros.append(zero)
    return Int4Linear(torch.cat(codes), torch.cat(scales), torch.cat(zeros), None)


def output():
    """SmolLM2's output layer (49152 x 576, Q8_0 in the file: int8 values q, a float16 scale d per 32)
    as two int4 products, q = 16 hi + lo: codes hi + 8 with scale 16d, codes lo with scale d and
    zero 8d; against the same values dense in bfloat16 (as `--weights q4` keeps it). Random values."""
    torch.manual_seed(0)
    n, k = 49152, 576
    q = torch.randint(-128, 128, (n, k), dtype=torch.int32)
    d = torch.rand(n, k // 32) * 0.01 + 0.001
    dense_w = (q.float().view(n, k // 32, 32) * d[..., None]).view(n, k).to(torch.bfloat16)
    hi = torch.div(q, 16, rounding_mode="floor")
    packed = [torch._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1) for c in (hi + 8, q - 16 * hi)]
    pairs = [torch.stack([s.t(), z.t()], -1).to(torch.bfloat16).contiguous()
             for s, z in ((16 * d, torch.zeros_like(d)), (d, 8 * d))]
    for rows in (1, 4, 16, 64):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        runs = {"bfloat16": lambda: torch.nn.functional.linear(x, dense_w),
                "two int4": lambda: sum(torch._weight_int4pack_mm_for_cpu(x, p, 32, sz) for p, sz in zip(packed, pairs))}
        for _ in range(3):
            [f() for f in runs.values()]
        times = interleaved(runs, blocks=30, calls=10)
        print(f"{rows:3d} rows: " + "  ".join(f"{name} {v:.2f} ms" for name, v in times.items()))


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "guards"
    with torch.no_grad():
        {"fusion": fusion, "output": output}[mode]() if mode in ("fusion", "output") else \
            {"guards": guards, "profile": profile}[mode](setup())
