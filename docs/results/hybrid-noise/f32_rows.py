"""The 210 decoder products of SmolLM2-135M in float32 at 1-8 rows: stock F.linear, x @ W^T, oneDNN packed, one
matrix-vector product per row; 30 distinct weight copies, median of 7 passes, ms (README.md beside this file)."""
import torch, time, statistics
torch.set_num_threads(2); torch.set_grad_enabled(False)
SHAPES=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
W=[torch.randn(n,k)*0.02 for _ in range(30) for n,k in SHAPES]
WT=[w.t().contiguous() for w in W]
P=[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in W]
def run(kind,x):
    for w,wt,p in zip(W,WT,P):
        xi=x[:, :w.shape[1]].contiguous()
        if kind=='linear': torch.nn.functional.linear(xi,w)
        elif kind=='x@wt': xi@wt
        elif kind=='onednn': torch.ops.mkldnn._linear_pointwise(xi,p,None,"none",[],"")
        elif kind=='rows': 
            for i in range(xi.shape[0]): torch.mv(w, xi[i])
def bench(kind,x):
    run(kind,x); run(kind,x); ts=[]
    for _ in range(7):
        t=time.perf_counter(); run(kind,x); ts.append(time.perf_counter()-t)
    return round(statistics.median(ts)*1e3,1)
for m in (1,2,3,4,8):
    x=torch.randn(m,1536)
    print(m,{k:bench(k,x) for k in ('linear','x@wt','onednn','rows')},flush=True)
