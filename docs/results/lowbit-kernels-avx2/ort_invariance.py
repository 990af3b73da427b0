import sys; import os; sys.path.insert(0, os.environ.get('ORT_SITE', '/tmp/ort'))  # pip install --target $ORT_SITE onnxruntime onnx
import numpy as np, onnx, time, statistics, torch
from onnx import helper, TensorProto, numpy_helper
import onnxruntime as ort
torch.set_num_threads(2)
rng=np.random.default_rng(0)
def sess(N,K,acc,zero=True):
    nb=K//32
    B=rng.integers(0,256,(N,nb,16),dtype=np.uint8); S=rng.random(N*nb).astype(np.float32)*0.01
    inits=[numpy_helper.from_array(B,"b"),numpy_helper.from_array(S,"s")]; ins=["x","b","s"]
    if zero:
        inits.append(numpy_helper.from_array(np.zeros(N*((nb+1)//2),np.uint8),"z")); ins.append("z")
    n=helper.make_node("MatMulNBits",ins,["y"],domain="com.microsoft",K=K,N=N,bits=4,block_size=32,accuracy_level=acc)
    g=helper.make_graph([n],"g",[helper.make_tensor_value_info("x",TensorProto.FLOAT,["M",K])],[helper.make_tensor_value_info("y",TensorProto.FLOAT,None)],inits)
    m=helper.make_model(g,opset_imports=[helper.make_opsetid("",17),helper.make_opsetid("com.microsoft",1)])
    so=ort.SessionOptions(); so.intra_op_num_threads=2
    return ort.InferenceSession(m.SerializeToString(),so,providers=["CPUExecutionProvider"]), B, S
for (N,K) in [(576,576),(3072,576),(576,1536),(960,576)]:
    s,B,S=sess(N,K,4)
    x=rng.standard_normal((16,K),dtype=np.float32)
    full=s.run(None,{"x":x})[0]
    ok=True
    for M in (1,2,3,5,8,16):
        part=s.run(None,{"x":x[:M]})[0]
        for i in range(M):
            one=s.run(None,{"x":x[i:i+1]})[0]
            if not np.array_equal(one[0],part[i]) or not np.array_equal(one[0], full[i]): ok=False
    # reference dequant check (symmetric zero=0): value = d*q
    q=np.stack([B & 15, B>>4],-1).reshape(N,K).astype(np.float32)
    W=q*np.repeat(S.reshape(N,K//32),32,1)
    ref=x@W.T
    err=np.abs(ref-full).max()/np.abs(ref).max()
    # overhead: one call at M=1 in a loop
    x1=x[:1].copy()
    for _ in range(20): s.run(None,{"x":x1})
    t=time.perf_counter()
    for _ in range(300): s.run(None,{"x":x1})
    per=(time.perf_counter()-t)/300*1e6
    xt=torch.from_numpy(x1)
    t=time.perf_counter()
    for _ in range(300): torch.from_numpy(s.run(None,{"x":xt.numpy()})[0])
    per2=(time.perf_counter()-t)/300*1e6
    print(N,K,'batch-invariant',ok,'rel err vs float',round(float(err),4),'us/call',round(per,1),'from torch',round(per2,1),flush=True)
