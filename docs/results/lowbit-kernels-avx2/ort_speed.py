import sys; import os; sys.path.insert(0, os.environ.get('ORT_SITE', '/tmp/ort'))  # pip install --target $ORT_SITE onnxruntime onnx
import numpy as np, onnx, time, statistics
from onnx import helper, TensorProto, numpy_helper
import onnxruntime as ort
shapes=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
rng=np.random.default_rng(0)
def model(acc, zp_kind, layers=30):
    nodes=[]; inits=[]; outs=[]
    for l in range(layers):
        for i,(N,K) in enumerate(shapes):
            nb=K//32
            B=rng.integers(0,256,(N,nb,16),dtype=np.uint8)
            S=(rng.random(N*nb).astype(np.float32)*0.01)
            name=f"w{l}_{i}"
            inits+= [numpy_helper.from_array(B,name+"_b"), numpy_helper.from_array(S,name+"_s")]
            ins=["x576" if K==576 else "x1536", name+"_b", name+"_s"]
            if zp_kind=='u8':
                Z=rng.integers(0,256,(N*((nb+1)//2),),dtype=np.uint8); inits.append(numpy_helper.from_array(Z,name+"_z")); ins.append(name+"_z")
            elif zp_kind=='f32':
                Z=(rng.random(N*nb).astype(np.float32)*0.01); inits.append(numpy_helper.from_array(Z,name+"_z")); ins.append(name+"_z")
            nodes.append(helper.make_node("MatMulNBits",ins,[name+"_y"],domain="com.microsoft",K=K,N=N,bits=4,block_size=32,accuracy_level=acc))
            outs.append(helper.make_tensor_value_info(name+"_y",TensorProto.FLOAT,None))
    g=helper.make_graph(nodes,"g",[helper.make_tensor_value_info("x576",TensorProto.FLOAT,["M",576]),helper.make_tensor_value_info("x1536",TensorProto.FLOAT,["M",1536])],outs,inits)
    m=helper.make_model(g,opset_imports=[helper.make_opsetid("",17),helper.make_opsetid("com.microsoft",1)])
    so=ort.SessionOptions(); so.intra_op_num_threads=2; so.inter_op_num_threads=1
    so.execution_mode=ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(m.SerializeToString(),so,providers=["CPUExecutionProvider"])
for acc in (0,4):
  for zp in ('none','u8','f32'):
    try:
        s=model(acc,zp)
    except Exception as e:
        print(acc,zp,'ERR',str(e)[:200]); continue
    res={}
    for M in (1,2,3,4,8):
        feed={"x576":rng.standard_normal((M,576),dtype=np.float32),"x1536":rng.standard_normal((M,1536),dtype=np.float32)}
        for _ in range(3): s.run(None,feed)
        ts=[]
        for _ in range(9):
            t=time.perf_counter(); s.run(None,feed); ts.append(time.perf_counter()-t)
        res[M]=round(statistics.median(ts)*1e3,2)
    print('acc',acc,'zp',zp,res,flush=True)
