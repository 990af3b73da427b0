"""Does a tree row's attention equal the one-token step's? (issue 32; README.md beside this file)
  python docs/results/q4-step-profile/layout_invariance.py
SmolLM2's shapes (9 query heads, 3 KV heads, head size 64), random inputs. A tree step's query row sees
the context plus some earlier tree nodes, the rest masked (-inf) and interleaved with them; the
sequential (`ar`) step for the same token sees exactly those keys, contiguous, unmasked. Counts the rows
whose outputs differ in any bit, per compute dtype; 'float64' computes in float64 from bfloat16 inputs and
rounds the output to bfloat16, as the shipped exact attention does."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
H, KV, D = 9, 3, 64


def attend(q, k, v, mask, compute):
    if compute == "float64":
        m = None if mask is None else mask.double()
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m,
                                              enable_gqa=True).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


rows = {}
for compute, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float64", torch.bfloat16)):
    differ = total = 0
    for ctx in (37, 300, 700, 1500, 2100):
        for q_len in (2, 5, 9, 16):
            k = torch.randn(1, KV, ctx + q_len, D).to(dtype)
            v = torch.randn(1, KV, ctx + q_len, D).to(dtype)
            q = torch.randn(1, H, q_len, D).to(dtype)
            allowed = torch.zeros(q_len, ctx + q_len, dtype=torch.bool)
            allowed[:, :ctx] = True
            for i in range(q_len):  # each node sees itself and a random set of earlier nodes (its ancestors)
                allowed[i, ctx + i] = True
                allowed[i, ctx:ctx + i] = torch.rand(i) < 0.5
            mask = torch.zeros(q_len, ctx + q_len, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]
            tree = attend(q, k, v, mask, compute)
            for i in range(q_len):
                seen = allowed[i].nonzero().flatten()
                one = attend(q[:, :, i:i + 1], k[:, :, seen], v[:, :, seen], None, compute)
                differ += int(not torch.equal(one[:, :, 0], tree[:, :, i]))
                total += 1
    rows[compute] = (differ, total)
    print(f"{compute:9s} rows differing: {differ} of {total}")
