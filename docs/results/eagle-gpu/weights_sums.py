"""Per-tensor float64 sums (and sums of squares) of the embedded target's float32 checkpoint as this
machine converts it from the GGUF: the GPU machine converts the same file with its own transformers and
must get the same weights before its answers count as the target's (`build.py --check`).
    python docs/results/eagle-gpu/weights_sums.py > docs/results/eagle-gpu/weights_sums.json"""
import json
import sys


def weight_sums(tensors: dict) -> dict:
    """name -> [float64 sum, float64 sum of squares] of each tensor (build.py compares these)."""
    return {k: [float(v.double().sum()), float(v.double().square().sum())] for k, v in sorted(tensors.items())}


if __name__ == "__main__":
    from safetensors.torch import load_file

    from dynatree.models import _locate

    directory = _locate(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")[0]
    print(json.dumps(weight_sums(load_file(f"{directory}/model.safetensors")), indent=0))
