"""The products of SmolLM2-135M's 30 decoder layers through PyTorch's CPU kernels, 30 distinct weight copies
(so nothing is served from cache), ms per pass over all 210 products at 1-8 rows; see README.md."""
import torch, time, statistics
torch.set_num_threads(2)
torch.manual_seed(0)
shapes=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
L=30
layers=[]
for l in range(L):
    for (N,K) in shapes:
        W=torch.randn(N,K)*0.02
        q=torch.randint(0,16,(N,K),dtype=torch.int32)
        layers.append(dict(N=N,K=K,f32=W,bf16=W.bfloat16(),
          i4=torch.ops.aten._convert_weight_to_int4pack_for_cpu(q,1), sz=torch.randn(K//32,N,2).bfloat16(),
          w8=torch.randint(-127,127,(N,K),dtype=torch.int8), s8=torch.rand(N).bfloat16()))
        layers[-1]['s8f']=layers[-1]['s8'].float()
def run(kind, M):
    xs={576:torch.randn(M,576), 1536:torch.randn(M,1536)}
    xb={k:v.bfloat16() for k,v in xs.items()}
    def f():
        for d in layers:
            K=d['K']
            if kind=='f32': torch.nn.functional.linear(xs[K],d['f32'])
            elif kind=='bf16': torch.nn.functional.linear(xb[K],d['bf16'])
            elif kind=='int4': torch.ops.aten._weight_int4pack_mm_for_cpu(xb[K],d['i4'],32,d['sz'])
            elif kind=='int8': torch.ops.aten._weight_int8pack_mm(xb[K],d['w8'],d['s8'])
            elif kind=='int8f32': torch.ops.aten._weight_int8pack_mm(xs[K],d['w8'],d['s8f'])
    return f
for M in (1,2,3,4,8):
    out={}
    for k in ('f32','bf16','int4','int8','int8f32'):
        f=run(k,M)
        for _ in range(2): f()
        ts=[]
        for _ in range(7):
            t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
        out[k]=round(statistics.median(ts)*1e3,2)
    print(M,out,flush=True)
