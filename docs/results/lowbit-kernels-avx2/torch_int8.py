import torch, time, statistics
torch.set_num_threads(2)
torch.manual_seed(0)
shapes=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
layers=[]
for l in range(30):
    for (N,K) in shapes:
        W=torch.randn(N,K)*0.02
        w8=torch.randint(-127,127,(N,K),dtype=torch.int8)
        d=dict(K=K,w8t=w8.t().contiguous().t(), w8=w8, w8kn=w8.t().contiguous())
        try:
            d['qw']=torch.ops.quantized.linear_prepack(torch.quantize_per_channel(W,torch.rand(N)*0.001+1e-4,torch.zeros(N,dtype=torch.long),0,torch.qint8),None)
        except Exception as e: print('prepack',e); 
        layers.append(d)
def run(kind,M):
    xs={576:torch.randn(M,576),1536:torch.randn(M,1536)}
    x8={k:torch.randint(-127,127,(M,k),dtype=torch.int8) for k in xs}
    def f():
        for d in layers:
            K=d['K']
            if kind=='int_mm': torch._int_mm(x8[K], d['w8kn'])
            elif kind=='int_mm_t': torch._int_mm(x8[K], d['w8'].t())
            elif kind=='fbgemm_dyn': torch.ops.quantized.linear_dynamic(xs[K], d['qw'])
    return f
for M in (1,2,4,8):
    out={}
    for k in ('int_mm','int_mm_t','fbgemm_dyn'):
        try:
            f=run(k,M); f(); f()
            ts=[]
            for _ in range(7):
                t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
            out[k]=round(statistics.median(ts)*1e3,2)
        except Exception as e: out[k]=str(e)[:80]
    print(M,out,flush=True)
