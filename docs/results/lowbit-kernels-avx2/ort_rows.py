import sys; import os; sys.path.insert(0, os.environ.get('ORT_SITE', '/tmp/ort'))  # pip install --target $ORT_SITE onnxruntime onnx
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'ort_invariance.py')).read().split("for (N,K) in")[0])
for (N,K) in [(576,576),(1536,576)]:
    s,B,S=sess(N,K,4)
    x=rng.standard_normal((16,K),dtype=np.float32)
    ones=np.concatenate([s.run(None,{"x":x[i:i+1]})[0] for i in range(16)])
    out=[]
    for M in (2,3,4,8,16):
        part=s.run(None,{"x":x[:M]})[0]
        d=np.abs(part-ones[:M]); out.append((M, int((d>0).sum()), part.size, float(d.max()/np.abs(ones).max())))
    print(N,K,out)
