"""Linear layers on oneDNN-packed weights (kernels.py): same numbers, same tokens, stock when asked."""

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import ON_CPU, fresh, hf_greedy, steps, tiny
from dynatree import api, cpu
from dynatree.errors import DynaTreeError
from dynatree.kernels import (PackedLinear, linear_kernel, packing_problem, repack_linears, stock_linears,
                              use_packed_linears)
from dynatree.models import load_model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (1, 5, 24)])
def test_packed_linear_matches_f_linear(bias, shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=bias)
    packed = PackedLinear(lin)
    x = torch.randn(shape)
    with torch.no_grad():
        got = packed(x)
        assert got.shape == shape[:-1] + (40,)
        torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def _linear(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16)).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_linears_follow_what_this_cpu_can_run(dtype):
    """Whichever branch this machine takes: packed where oneDNN runs the dtype, stock with the
    reason (and a one-line error for --linear onednn) where it does not (e.g. AVX2-only CPUs)."""
    model = _linear(dtype)
    x = torch.randn(4, 32, dtype=dtype)
    with torch.no_grad():
        expected = F.linear(x, model[0].weight, model[0].bias).float()
    problem = cpu.onednn_linear_problem(dtype)
    if problem is None:
        assert packing_problem(model) is None
        assert use_packed_linears(model, "auto") == "onednn"
    else:
        assert packing_problem(model) == f"this CPU ({cpu.capability()}) cannot run oneDNN's {dtype_name(dtype)} linear: {problem}"
        with pytest.raises(DynaTreeError, match="use --linear stock or --dtype float32$"):
            use_packed_linears(model, "onednn")
        assert use_packed_linears(model, "auto") == "stock"
    with torch.no_grad():
        torch.testing.assert_close(model(x).float(), expected, rtol=2e-2, atol=2e-2)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def test_a_cpu_without_the_dtype_path_gets_stock_kernels_and_the_reason(monkeypatch):
    """The unsupported branch on every machine: the probe is faked to fail as on an AVX2-only CPU."""
    missing = "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
    monkeypatch.setattr(cpu, "onednn_linear_problem", lambda dtype: missing if dtype == torch.bfloat16 else None)
    model = _linear(torch.bfloat16)
    assert use_packed_linears(model, "auto") == "stock" and linear_kernel(model) == "stock"
    assert missing in packing_problem(model)
    with pytest.raises(DynaTreeError) as err:
        use_packed_linears(model, "onednn")
    assert str(err.value) == ("--linear onednn: cannot pack this model's linear layers: this CPU "
                              f"({cpu.capability()}) cannot run oneDNN's bfloat16 linear: {missing}; "
                              "use --linear stock or --dtype float32")
    assert use_packed_linears(_linear(torch.float32), "auto") == "onednn"  # float32 is another question


def test_a_cpu_with_the_dtype_path_packs_it(monkeypatch):
    """The supported branch on every machine: probe and oneDNN ops faked (weights kept as they are,
    F.linear for the product), so the choice and the plumbing of packed bf16 layers run everywhere."""
    monkeypatch.setattr(cpu, "onednn_linear_problem", lambda dtype: None)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, b: w.clone())
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, b, *rest: F.linear(x, w, b))
    model = fresh("llama", torch.bfloat16)
    prompt = torch.tensor([[5, 9, 14, 9, 5]])
    with torch.no_grad():
        ref = model(prompt).logits
        assert packing_problem(model) is None
        assert use_packed_linears(model, "auto") == "onednn"
        assert all(type(m) is not torch.nn.Linear for m in model.modules())
        assert torch.equal(model(prompt).logits, ref)


def test_probe_reports_onednn_s_own_words(monkeypatch):
    def refuse(w, b):
        raise RuntimeError("mkldnn_reorder_linear_weight: fp16 path needs the cpu support avx_ne_convert or avx512_fp16")

    cpu.onednn_linear_problem.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
            assert cpu.onednn_linear_problem(torch.float16) == "fp16 path needs the cpu support avx_ne_convert or avx512_fp16"
    finally:
        cpu.onednn_linear_problem.cache_clear()  # the real answers again for later tests
    assert cpu.onednn_linear_problem(torch.float32) is None  # float32 runs on every x86 CPU oneDNN supports
    info = cpu.describe()
    assert info["capability"] == torch.backends.cpu.get_cpu_capability()
    assert "float32" in info["onednn_linear_dtypes"]
    assert cpu.summary(info).startswith(f"{info['capability']}, oneDNN linear in float32")


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
def test_swap_keeps_parameters_and_ties(arch):
    model = fresh(arch)
    before = [id(p) for p in model.parameters()]
    keys = set(model.state_dict())
    assert use_packed_linears(model, "onednn") == "onednn"
    assert [id(p) for p in model.parameters()] == before  # the same Parameters, nothing copied into them
    assert set(model.state_dict()) == keys
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert linear_kernel(model) == "onednn"


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
def test_packed_model_logits_close_and_stock_block_exact(arch):
    plain = fresh(arch)
    packed = copy.deepcopy(plain)
    use_packed_linears(packed, "onednn")
    ref = steps(plain)
    got = steps(packed)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    with stock_linears(packed):
        assert linear_kernel(packed) == "stock"
        for r, g in zip(ref, steps(packed)):
            assert torch.equal(g, r)  # F.linear on the same weights: bit for bit
    assert linear_kernel(packed) == "onednn"


def test_stock_block_switches_back_on_error():
    model = fresh("llama")
    use_packed_linears(model)
    with pytest.raises(RuntimeError):
        with stock_linears(model, None):
            raise RuntimeError("boom")
    assert linear_kernel(model) == "onednn"


@pytest.mark.parametrize("method,draft", [("ar", None), ("dynatree", "ngram"), ("fixed-tree", "ngram")])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_greedy_tokens_equal_transformers_stock(arch, method, draft):
    target = tiny(arch, seed=1, dtype=torch.float32)
    kernel = "onednn" if ON_CPU else "stock"  # on a GPU: float32 greedy on cuBLAS equals transformers'
    assert target.linear == kernel
    prompt = [5, 9, 2, 7, 5, 9, 2, 11, 3, 5, 9]
    ref = hf_greedy(target, prompt, 40)  # transformers' generate on its stock kernels
    out = api.generate(method=method, target=target, draft=draft, prompt_ids=prompt, max_new_tokens=40,
                       ignore_eos=True)
    assert out.new_token_ids == ref
    assert out.run.linear == kernel


def test_gradients_flow_through_the_original_weight():
    model = fresh("llama")
    use_packed_linears(model)
    model.train()
    with torch.enable_grad():
        loss = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
        loss.backward()
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, PackedLinear) and layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_repack_follows_in_place_weight_changes():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    packed = PackedLinear(lin)
    x = torch.randn(2, 16)
    with torch.no_grad():
        lin.weight.mul_(2.0)
        stale = packed(x)
        assert not torch.allclose(stale, F.linear(x, lin.weight, lin.bias), atol=1e-3)
        parent = torch.nn.Sequential(packed)
        repack_linears(parent)
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_kernel_choices_and_errors(monkeypatch):
    model = fresh("llama", torch.float64)
    assert use_packed_linears(model, "auto") == "stock"  # oneDNN packs float32 and bfloat16 only
    assert any(type(m) is torch.nn.Linear for m in model.modules())
    with pytest.raises(DynaTreeError, match=r"--linear onednn: cannot pack this model's linear layers: dtype float64 "
                       r"\(oneDNN packs float32, bfloat16 and float16\); use --linear stock"):
        use_packed_linears(model, "onednn")
    with pytest.raises(DynaTreeError, match="unknown linear kernel 'mkl'"):
        use_packed_linears(model, "mkl")
    fp32 = fresh("llama")
    assert use_packed_linears(fp32, "stock") == "stock"
    assert any(type(m) is torch.nn.Linear for m in fp32.modules())
    import dynatree.kernels as kernels
    monkeypatch.setattr(kernels, "MAX_RAM_SHARE", 0.0)  # "the second copy would not fit"
    assert use_packed_linears(fp32, "auto") == "stock"
    assert use_packed_linears(fp32, "onednn") == "onednn"  # asked for explicitly: packed anyway


def test_load_model_linear_option(saved_tiny):
    assert load_model(str(saved_tiny)).linear == "onednn"
    stock = load_model(str(saved_tiny), linear="stock")
    assert stock.linear == "stock" and linear_kernel(stock.model) == "stock"
    with pytest.raises(DynaTreeError, match="unknown linear kernel"):
        load_model(str(saved_tiny), linear="fast")


def test_hf_baseline_runs_stock_kernels(saved_tiny):
    target = load_model(str(saved_tiny))
    seen = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: seen.append(m.enabled) if isinstance(m, PackedLinear) else None)
    try:
        out = api.generate(method="hf-ar", target=target, prompt_ids=[3, 4, 5], max_new_tokens=3, ignore_eos=True)
    finally:
        hook.remove()
    assert seen and not any(seen)
    assert out.run.linear == "stock"
    assert linear_kernel(target.model) == "onednn"


def test_deepcopy_packs_its_own_copy():
    model = fresh("llama")
    use_packed_linears(model)
    twin = copy.deepcopy(model)
    assert linear_kernel(twin) == "onednn"
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
        repack_linears(twin)
        ids = torch.tensor([[1, 2, 3]])
        with stock_linears(twin):
            ref = twin(input_ids=ids).logits
        torch.testing.assert_close(twin(input_ids=ids).logits, ref, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(model(input_ids=ids).logits, ref, atol=1e-3)  # the original kept its weights
    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # packed float32 copy no longer matches: F.linear
    with torch.no_grad():
        assert bf16(input_ids=ids).logits.dtype == torch.bfloat16


def _compiled_graph_ops(module, x):
    """The operators dynamo records for `module(x)` (a capturing backend; nothing is compiled)."""
    ops = []

    def capture(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method"))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=capture, dynamic=False)(x)
    return ops


def test_compiled_graphs_use_the_packed_op_for_several_rows_and_a_multiply_sum_for_one():
    torch.manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(24, 40))
    with torch.no_grad():
        several = _compiled_graph_ops(layer, torch.randn(1, 3, 24))
        one = _compiled_graph_ops(layer, torch.randn(1, 1, 24))
    packed, linear = "dynatree.packed_linear", "<built-in function linear>"
    assert packed in several and linear not in several
    assert packed not in one and linear not in one and any("sum" in op for op in one)  # a multiply-sum for inductor


def test_compiled_packed_layers_match_f_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8, bias=False)).eval()
    use_packed_linears(model, "onednn")
    first = model[0]
    x = torch.randn(1, 5, 24)
    with torch.no_grad():
        expected = F.linear(F.gelu(F.linear(x, first.weight, first.bias)), model[2].weight)
        direct = torch.ops.dynatree.packed_linear(x, first.weight, first.bias, first.slot)
        torch.testing.assert_close(direct, F.linear(x, first.weight, first.bias), rtol=1e-5, atol=1e-5)
        # a weight that is not the slot's (never expected) is still multiplied correctly, and said so
        other = torch.randn(40, 24)
        with pytest.warns(RuntimeWarning, match="computing F.linear instead"):
            fallback = torch.ops.dynatree.packed_linear(x, other, None, first.slot)
        torch.testing.assert_close(fallback, F.linear(x, other))
        torch._dynamo.reset()
        compiled = torch.compile(model)  # as runtime.LoadedModel.compiled does (no freezing)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)
        row = x[:, :1]  # one row: the multiply-sum path
        torch.testing.assert_close(compiled(row), expected[:, :1], rtol=1e-5, atol=1e-5)


def test_importing_the_engine_registers_no_operator_and_changes_no_torch_setting():
    """Import side effects (issue 30): the packed-linear operator is defined by the first PackedLinear,
    dynamo's settings are changed by the first compiled model, not by `import dynatree...`."""
    code = """
import torch
before = (torch._dynamo.config.recompile_limit, torch.compiler.config.dynamic_sources)
import dynatree.api, dynatree.decode, dynatree.kernels, dynatree.runtime, dynatree.cli, dynatree.bench.runner
assert (torch._dynamo.config.recompile_limit, torch.compiler.config.dynamic_sources) == before
try:
    torch.ops.dynatree.packed_linear
    raise SystemExit("dynatree::packed_linear registered at import")
except (AttributeError, RuntimeError):
    pass
dynatree.kernels.use_packed_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval())
torch.ops.dynatree.packed_linear  # defined now
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
