"""Per-tensor float64 sums (and sums of squares) of the embedded target's float32 checkpoint as this
machine converts it from the GGUF: the GPU machine converts the same file with its own transformers and
must get the same weights before its answers count as the target's (`build.py --check`).
    python docs/results/eagle-gpu/weights_sums.py > docs/results/eagle-gpu/weights_sums.json"""
import json
import sys

from safetensors.torch import load_file

from dynatree.models import _locate

directory = _locate(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")[0]
tensors = load_file(f"{directory}/model.safetensors")
print(json.dumps({k: [float(v.double().sum()), float(v.double().square().sum())] for k, v in sorted(tensors.items())},
                 indent=0))
