"""Weight formats (weights.py): a GGUF file's 4-bit codes kept as they are, int8 per channel, the
errors for what a model or device cannot take, and what greedy decoding in those formats keeps."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from dynatree import generate
from dynatree.errors import DynaTreeError
from dynatree.models import load_model
from dynatree.runtime import LoadedModel
from dynatree.kernels import linear_kernel, use_packed_linears
from dynatree.draftload import load_draft
from dynatree.drafters import FeatureDrafter
from dynatree.featurehead import load_head
from dynatree.weights import (Int4Linear, Int8Linear, apply_weights, inexact_greedy, int4_linear, quantized_layers,
                              read_q4_rows, resolve_auto, row_dependent_layers, use_int8, use_q4, weights_dtype)
from helpers import config, examples, random_head, tokenizer
from transformers import AutoModelForCausalLM

Q4_0, Q4_1, F32 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.F32


def _fresh_llama(seed: int = 0) -> torch.nn.Module:
    """A float32 tiny Llama of our own, on plain nn.Linear layers as transformers loads it (the
    helpers' models are shared, and their linears are packed already)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config("llama", 96, 128)).float().eval()


def _write_gguf(path, tensors: dict) -> None:
    writer = GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        data = quantize(values, kind) if kind != F32 else values
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantized_copy(model: torch.nn.Module, path, skip=("lm_head",)) -> dict[str, torch.Tensor]:
    """Round every linear weight but the output layer to Q4_0/Q4_1 values (as transformers loads a
    GGUF file), write the codes to a GGUF file at `path`, with the q projections' rows stored in
    another order (as llama GGUF files store them); return the rounded weights by module name."""
    tensors, rounded = {}, {}
    for i, (name, layer) in enumerate((n, m) for n, m in model.named_modules()
                                      if isinstance(m, torch.nn.Linear) and n not in skip):
        kind = Q4_1 if i % 2 else Q4_0
        values = layer.weight.detach().numpy()
        codes_order = values[::-1].copy() if name.endswith("q_proj") else values
        tensors[name] = (codes_order, kind)
        exact = dequantize(quantize(values, kind), kind).astype(np.float32)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(exact))
        rounded[name] = layer.weight.detach().clone()
    _write_gguf(path, tensors)
    return rounded


def test_q4_keeps_the_files_codes_for_every_layer_it_finds_by_value(tmp_path):
    model = _fresh_llama()
    rounded = _quantized_copy(model, tmp_path / "tiny.gguf")
    note = use_q4(model, read_q4_rows(tmp_path / "tiny.gguf"), "tiny.gguf")
    layers = dict(model.named_modules())
    assert note == f"q4: {len(rounded)} linear layers on the file's 4-bit codes; dense (bfloat16): lm_head"
    assert isinstance(layers["lm_head"], torch.nn.Linear)
    for name, weight in rounded.items():
        layer = layers[name]
        assert isinstance(layer, Int4Linear), name
        # the same values as the dequantized file, up to the scales and offsets rounded to bfloat16
        scale = weight.abs().amax(dim=1, keepdim=True)
        assert ((layer.dequantized() - weight).abs() <= 2 ** -7 * scale + 1e-6).all(), name


def test_q4_layers_compute_what_their_dequantized_weight_computes(tmp_path):
    model = _fresh_llama(seed=1)
    _quantized_copy(model, tmp_path / "tiny.gguf")
    use_q4(model, read_q4_rows(tmp_path / "tiny.gguf"), "tiny.gguf")
    x = torch.randn(5, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    layer = model.model.layers[0].self_attn.q_proj
    reference = x.float() @ layer.dequantized().t()
    torch.testing.assert_close(layer(x).float(), reference, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("make", [
    lambda w: Int4Linear(torch.randint(0, 16, w.shape), torch.rand(w.shape[0], w.shape[1] // 32) / 8,
                         torch.randn(w.shape[0], w.shape[1] // 32) / 8, None),
    lambda w: Int8Linear(w, torch.randn(w.shape[0])),
], ids=["q4", "int8"])
def test_each_output_row_depends_on_its_own_input_row_only(make):
    """Bit for bit, a row computed in a batch of 1, 3 or 8 rows: what makes a verified chain of
    drafted tokens give the logits one-token steps give."""
    gen = torch.Generator().manual_seed(0)
    layer = make(torch.randn(48, 64, generator=gen))
    x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    full = layer(x)
    for rows in (1, 3):
        assert torch.equal(layer(x[:rows]), full[:rows])
    assert torch.equal(layer(x[5:6]), full[5:6])


def test_int8_quantizes_each_output_channel_within_half_a_step():
    model = _fresh_llama(seed=2)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert use_int8(model) == (f"int8: {len(weights)} linear layers quantized per output channel; "
                               "dense (bfloat16): output layer")
    layers = dict(model.named_modules())
    assert isinstance(layers["lm_head"], torch.nn.Linear)
    for name, weight in weights.items():
        step = layers[name].scales.float()[:, None]
        assert (step * 127 >= weight.abs().amax(dim=1, keepdim=True)).all(), name
        assert ((layers[name].dequantized() - weight).abs() <= step / 2 * (1 + 1e-6)).all(), name


def _loaded(model: torch.nn.Module, weights: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=tokenizer(96), name=f"tiny-{weights}", eos_ids=[], weights=weights)


@functools.cache
def _low_bit_target(weights: str, seed: int) -> LoadedModel:
    """A tiny Llama in a low-bit format, prepared as load_model prepares one: converted, its dense
    output layer packed for oneDNN, its dense layers checked for row-wise results."""
    model = _fresh_llama(seed)
    if weights == "q4":
        path = Path(tempfile.mkdtemp()) / "tiny.gguf"
        _quantized_copy(model, path)
    apply_weights(model, weights, torch.device("cpu"), path if weights == "q4" else None, "tiny")
    use_packed_linears(model)
    loaded = _loaded(model, weights)
    loaded.row_dependent = row_dependent_layers(model)
    return loaded


@pytest.mark.parametrize("weights", ["q4", "int8"])
@pytest.mark.parametrize("method", ["linear", "fixed-tree", "dynatree", "specinfer", "wetap"])
@settings(max_examples=examples(6), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_greedy_in_a_low_bit_format_equals_ar_in_that_format(weights, method, data):
    """Every method's greedy output is `ar`'s in the same format, token for token: tree steps
    compute each row bit for bit as one-token steps (row-wise kernels, float64 attention)."""
    target = _low_bit_target(weights, data.draw(st.integers(0, 2), label="seed"))
    assert target.row_dependent == [], "a dense layer left in the low-bit model is not row-wise on this machine"
    motif = data.draw(st.lists(st.integers(3, 95), min_size=2, max_size=5), label="motif")
    prompt = (motif * 4)[: data.draw(st.integers(4, 20), label="length")]
    # the n-gram drafter, or the target itself as its draft LM: every drafted token is then the
    # target's own greedy choice in one-token steps, accepted unless the tree step rounds otherwise
    draft = data.draw(st.sampled_from(["ngram", target]), label="draft")
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=24, ignore_eos=True)
    spec = generate(method=method, target=target, draft=draft, prompt_ids=prompt, max_new_tokens=24, ignore_eos=True)
    assert ar.run.weights == weights and ar.run.dtype == "bfloat16"
    assert spec.new_token_ids == ar.new_token_ids


@pytest.mark.parametrize("weights", ["q4", "int8"])
def test_low_bit_trees_accept_drafted_tokens_deep(weights):
    """The exactness test above is not vacuous: with the target as its own draft, trees verified in
    bfloat16 accept nearly every drafted token, several per pass (a rounding difference between
    tree and one-token steps would reject them)."""
    target = _low_bit_target(weights, 0)
    for method, least in (("linear", 3.9), ("dynatree", 1.5)):  # linear: k=5, all accepted; a flat tiny model's
        spec = generate(method=method, target=target, draft=target, prompt_ids=[5, 6, 7, 8, 9],  # trees prune
                        max_new_tokens=40, ignore_eos=True)
        assert spec.stats.accepted_len >= least, method


def test_q4_needs_a_gguf_file_with_4_bit_tensors(tmp_path):
    with pytest.raises(DynaTreeError, match=r"^--weights q4 keeps a GGUF file's 4-bit weights; tiny is not a \.gguf"):
        apply_weights(_fresh_llama(), "q4", torch.device("cpu"), None, "tiny")
    _write_gguf(tmp_path / "dense.gguf", {"w": (np.ones((16, 32), dtype=np.float32), F32)})
    with pytest.raises(DynaTreeError, match=r"linear layers are stored as Q4_0 or Q4_1; dense\.gguf holds 1 F32: "
                                            r"use --weights int8 or dense$"):
        apply_weights(_fresh_llama(), "q4", torch.device("cpu"), tmp_path / "dense.gguf", "dense.gguf")


def test_bad_weight_formats_and_dtypes_are_one_line_errors():
    with pytest.raises(DynaTreeError, match=r"unknown weight format 'q3' \(--weights\); choose one of auto, dense, q4, int8"):
        weights_dtype("q3", None)
    with pytest.raises(DynaTreeError, match=r"--weights int8 computes with bfloat16 activations .* drop --dtype "
                                            r"float32 or pass --dtype bfloat16"):
        weights_dtype("int8", "float32")
    assert weights_dtype("q4", None) == "bfloat16" and weights_dtype("dense", None) == "float32"
    with pytest.raises(DynaTreeError, match=r"--weights q4 runs on the CPU only"):
        apply_weights(_fresh_llama(), "q4", torch.device("meta"), None, "tiny")


def test_the_cli_refuses_q4_for_a_checkpoint_directory_and_runs_int8(saved_tiny, capsys):
    from dynatree.cli import main

    assert main(["generate", "w5 w6", "--target", str(saved_tiny), "--weights", "q4", "--max-new-tokens", "4"]) == 2
    assert f"--weights q4 keeps a GGUF file's 4-bit weights; {saved_tiny} is not a .gguf file" in capsys.readouterr().err
    assert main(["generate", "w5 w6", "--target", str(saved_tiny), "--weights", "int8", "--dtype", "float16"]) == 2
    assert "drop --dtype float16 or pass --dtype bfloat16" in capsys.readouterr().err
    model = load_model(str(saved_tiny), weights="int8")
    assert model.weights == "int8" and model.dtype == torch.bfloat16
    assert model.weights_note.startswith("int8: ") and quantized_layers(model.model)


def test_a_request_keeps_a_loaded_targets_format(saved_tiny):
    model = load_model(str(saved_tiny), weights="int8")
    with pytest.raises(DynaTreeError, match=r"already loaded with 'int8' weights"):
        generate("w5 w6", "ar", target=model, weights="dense", max_new_tokens=2)
    assert generate("w5 w6", "ar", target=model, weights="int8", max_new_tokens=2).run.weights == "int8"


@pytest.mark.slow
def test_the_embedded_model_in_q4_holds_the_files_own_4_bit_weights_and_decodes_exactly():
    """SmolLM2's 210 linear layers are Q4_1 in the GGUF file; its output layer is Q8_0 (tied to the
    embeddings) and stays bfloat16. Each 4-bit layer's values are the float32 model's, up to the
    scale and offset rounded to bfloat16. A chat answer by trees (n-gram, feature head) is `ar`'s."""
    q4 = load_model("smollm2-135m", weights="q4")
    assert q4.weights_note == "q4: 210 linear layers on the file's 4-bit codes; dense (bfloat16): lm_head"
    question = "Explain in three sentences why the sky is blue, then repeat your answer word for word."
    ar = generate(question, "ar", target=q4, chat=True, max_new_tokens=96)
    for method, draft in (("dynatree", "ngram"), ("fixed-tree", "smollm2-135m-eagle")):
        spec = generate(question, method, target=q4, draft=draft, chat=True, max_new_tokens=96)
        assert spec.new_token_ids == ar.new_token_ids, method
        assert spec.stats.accepted_tokens >= 5, method  # drafted tokens were accepted
    dense = dict(load_model("smollm2-135m").model.named_modules())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        weight = dense[name].weight.detach().float()
        got = dict(q4.model.named_modules())[name].dequantized()
        assert ((got - weight).abs() <= 2 ** -7 * weight.abs().amax(dim=1, keepdim=True) + 1e-6).all(), name


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["q4", "int8"])
def test_compiled_greedy_in_a_low_bit_format_equals_compiled_ar(weights):
    """Under torch.compile too (its one-token and tree graphs round intermediates as eager code
    does, and one row goes through the same output-layer kernel as several: models.py, kernels.py)."""
    target = _low_bit_target(weights, 1)
    prompt = [5, 9, 14, 9, 5, 9, 14, 30, 7, 5, 9]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=32, ignore_eos=True, compile=True)
    for method, draft in (("dynatree", "ngram"), ("fixed-tree", target), ("linear", target)):
        spec = generate(method=method, target=target, draft=draft, prompt_ids=prompt, max_new_tokens=32,
                        ignore_eos=True, compile=True)
        assert spec.run.compile is True
        assert spec.new_token_ids == ar.new_token_ids, method
    assert spec.stats.accepted_len >= 3.5  # linear with the target as draft: all but the last pass accept 4


def test_dense_16_bit_greedy_speculation_says_it_may_differ_from_ar(saved_tiny, capsys):
    """Dense bfloat16/float16 kernels are not row-wise (weights.inexact_greedy): the CLI and the
    record say so for greedy speculative runs; float32 and the low-bit formats say nothing."""
    from dynatree.cli import main

    assert main(["generate", "w5 w6 w7", "--target", str(saved_tiny), "--dtype", "bfloat16", "--draft", "ngram",
                 "--max-new-tokens", "4", "--json"]) == 0
    out = capsys.readouterr()
    assert ("note: dense bfloat16 weights: tree steps round some values otherwise than one-token steps, so greedy "
            "output may differ from ar's; float32 and --weights q4/int8 keep it exact") in out.err
    assert "dense bfloat16 weights" in json.loads(out.out)["run"]["inexact_greedy"]
    for flags in (["--dtype", "float32"], ["--weights", "int8"], ["--dtype", "bfloat16", "--method", "ar"],
                  ["--dtype", "bfloat16", "--sample"]):
        assert main(["generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "4", "--json",
                     *flags]) == 0
        out = capsys.readouterr()
        assert "may differ from ar" not in out.err and json.loads(out.out)["run"]["inexact_greedy"] is None, flags


def test_auto_is_q4_only_for_a_gguf_target_with_4_bit_layers_on_the_cpu(tmp_path, saved_tiny):
    model = _fresh_llama()
    _quantized_copy(model, tmp_path / "tiny.gguf")
    cpu = torch.device("cpu")
    weights, rows = resolve_auto("auto", None, cpu, tmp_path / "tiny.gguf")
    assert weights == "q4" and rows.codes
    assert resolve_auto("auto", "bfloat16", cpu, tmp_path / "tiny.gguf")[0] == "q4"
    assert resolve_auto("auto", "float32", cpu, tmp_path / "tiny.gguf") == ("dense", None)  # the dtype asked for
    assert resolve_auto("auto", None, torch.device("meta"), tmp_path / "tiny.gguf") == ("dense", None)
    assert resolve_auto("auto", None, cpu, None) == ("dense", None)  # not from a GGUF file
    _write_gguf(tmp_path / "dense.gguf", {"w": (np.ones((16, 32), dtype=np.float32), F32)})
    assert resolve_auto("auto", None, cpu, tmp_path / "dense.gguf") == ("dense", None)
    for _ in range(2):  # with the row cache (as load_model passes it): written empty, then read back
        assert resolve_auto("auto", None, cpu, tmp_path / "dense.gguf", cache_dir=tmp_path / "q4") == ("dense", None)
    assert len(list((tmp_path / "q4").glob("dense-*.npz"))) == 1
    with pytest.raises(DynaTreeError, match=r"dense\.gguf holds 1 F32: use --weights int8 or dense$"):
        apply_weights(_fresh_llama(), "q4", cpu, tmp_path / "dense.gguf", "dense.gguf",
                      resolve_auto("q4", None, cpu, tmp_path / "dense.gguf", cache_dir=tmp_path / "q4")[1])
    assert resolve_auto("int8", None, cpu, tmp_path / "tiny.gguf") == ("int8", None)
    loaded = load_model(str(saved_tiny), weights="auto")
    assert loaded.weights == "dense" and loaded.dtype == torch.float32


def test_cached_rows_are_keyed_by_the_files_content_so_copies_share_one_entry(tmp_path):
    """A reinstalled package or another virtual environment holds a copy of the same GGUF file at
    another path (and time): it reuses the cache entry instead of adding one (the cache grew by a
    converted model per copy when entries were keyed by path and modification time)."""
    import hashlib
    import os
    import shutil

    from dynatree.weights import file_key

    _quantized_copy(_fresh_llama(), tmp_path / "tiny.gguf")
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "tiny.gguf", tmp_path / "elsewhere" / "tiny.gguf")
    os.utime(tmp_path / "elsewhere" / "tiny.gguf", (1, 1))
    first = read_q4_rows(tmp_path / "tiny.gguf", tmp_path / "q4")
    again = read_q4_rows(tmp_path / "elsewhere" / "tiny.gguf", tmp_path / "q4")
    assert len(list((tmp_path / "q4").glob("*.npz"))) == 1 and again.index == first.index
    want = hashlib.sha256((tmp_path / "tiny.gguf").read_bytes()).hexdigest()[:16]
    assert file_key(tmp_path / "tiny.gguf") == want
    assert len(list((tmp_path / "keys").glob("*.key"))) == 2  # one per (path, size, time): read once each
    _quantized_copy(_fresh_llama(seed=1), tmp_path / "elsewhere" / "tiny.gguf")  # other content: its own entry
    read_q4_rows(tmp_path / "elsewhere" / "tiny.gguf", tmp_path / "q4")
    assert len(list((tmp_path / "q4").glob("*.npz"))) == 2


def test_auto_keeps_a_model_dense_when_no_layer_matches_but_q4_by_name_is_an_error(tmp_path):
    """A GGUF file with a 4-bit tensor that is no layer of the model: auto says why it stayed
    dense (and the model is the float32 one); --weights q4 refuses in one line."""
    model = _fresh_llama()
    _write_gguf(tmp_path / "other.gguf", {"x": (np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32),
                                                Q4_1)})
    weights, rows = resolve_auto("auto", None, torch.device("cpu"), tmp_path / "other.gguf")
    assert weights == "q4" and rows.codes  # the file has 4-bit tensors: auto tries q4
    with pytest.raises(DynaTreeError, match=r"^--weights q4 needs a GGUF file whose linear layers are stored as Q4_0 "
                                            r"or Q4_1; other\.gguf holds 1 Q4_1: use --weights int8 or dense$"):
        apply_weights(model, "q4", torch.device("cpu"), tmp_path / "other.gguf", "other.gguf", rows)
    assert next(model.parameters()).dtype == torch.float32 and not quantized_layers(model)  # untouched


def test_q4_keeps_an_output_layer_stored_in_4_bits_dense(tmp_path):
    """The output layer stays dense even when the file stores it in 4 bits: drafters read its rows
    and it is often tied to the embeddings."""
    model = _fresh_llama(seed=4)
    rounded = _quantized_copy(model, tmp_path / "with-head.gguf", skip=())
    assert "lm_head" in rounded  # the file holds the output layer's rows in 4 bits too
    note = use_q4(model, read_q4_rows(tmp_path / "with-head.gguf"), "with-head.gguf")
    assert isinstance(model.lm_head, torch.nn.Linear) and note.endswith("dense (bfloat16): lm_head")
    assert note.startswith(f"q4: {len(rounded) - 1} linear layers")


def test_int8_refuses_a_model_without_linear_layers():
    """GPT-2 computes with Conv1D layers, not nn.Linear: int8 says so instead of quantizing nothing."""
    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(config("gpt2", 96, 128)).float().eval()
    with pytest.raises(DynaTreeError, match=r"^--weights int8 found no nn\.Linear layers to quantize \(this model's are "
                                            r"Conv1D, Linear\): use --weights dense$"):
        use_int8(gpt2)


def test_a_dense_layer_that_rounds_rows_by_batch_size_is_found_and_said():
    class ByBatch(torch.nn.Linear):  # adds a trace of the batch size: not row-wise
        def forward(self, x):
            return super().forward(x) + 1e-2 * x.reshape(-1, x.shape[-1]).shape[0]

    model = torch.nn.Sequential(torch.nn.Linear(32, 16), ByBatch(32, 16)).to(torch.bfloat16)
    assert row_dependent_layers(model) == ["1"]
    assert inexact_greedy(torch.bfloat16, "q4", ["1"]) == (
        "q4 weights: the dense layer(s) 1 round a row differently in a multi-row call on this machine, so greedy "
        "output may differ from ar's")
    assert inexact_greedy(torch.bfloat16, "q4", []) is None


def test_transformers_greedy_on_a_low_bit_model_equals_ar():
    """hf-ar keeps the low-bit model's float64 attention (attention.stock_attention)."""
    target = _low_bit_target("q4", 0)
    prompt = [5, 9, 14, 9, 5, 9, 14, 30]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=20, ignore_eos=True)
    hf = generate(method="hf-ar", target=target, prompt_ids=prompt, max_new_tokens=20, ignore_eos=True)
    assert hf.new_token_ids == ar.new_token_ids


def test_a_torch_without_the_low_bit_kernels_is_refused_and_auto_stays_dense(monkeypatch, tmp_path):
    from dynatree.weights import check_device

    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    with pytest.raises(DynaTreeError, match=r"^--weights q4 needs torch\._weight_int4pack_mm_for_cpu, which torch .* "
                                            r"lacks: upgrade torch$"):
        check_device("q4", torch.device("cpu"))
    model = _fresh_llama()
    _quantized_copy(model, tmp_path / "tiny.gguf")
    assert resolve_auto("auto", None, torch.device("cpu"), tmp_path / "tiny.gguf") == ("dense", None)


def test_the_files_4_bit_rows_are_cached_and_a_damaged_entry_is_rebuilt(tmp_path):
    """Later loads read the rows from the cache (the file's metadata alone takes seconds)."""
    model = _fresh_llama(seed=5)
    _quantized_copy(model, tmp_path / "tiny.gguf")
    fresh = read_q4_rows(tmp_path / "tiny.gguf")
    first = read_q4_rows(tmp_path / "tiny.gguf", tmp_path / "cache")
    (entry,) = (tmp_path / "cache").glob("*.npz")
    again = read_q4_rows(tmp_path / "tiny.gguf", tmp_path / "cache")
    for rows in (first, again):
        assert rows.index == fresh.index and rows.types == fresh.types
        for mine, theirs in zip((rows.codes, rows.scale, rows.zero), (fresh.codes, fresh.scale, fresh.zero)):
            assert len(mine) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(mine, theirs))
    whole = entry.read_bytes()
    for damage in (b"not a cache entry", whole[: len(whole) // 2]):  # garbage; a half-written zip (BadZipFile)
        entry.write_bytes(damage)
        rebuilt = read_q4_rows(tmp_path / "tiny.gguf", tmp_path / "cache")
        assert rebuilt.index == fresh.index and np.array_equal(rebuilt.codes[0], fresh.codes[0])
        assert entry.stat().st_size == len(whole)  # rewritten


def test_int4_linear_fits_each_group_of_32_no_worse_than_its_min_max_levels():
    """Q4_1's levels (minimum to maximum, codes to nearest) are the start; the least-squares fit a group
    keeps only where its squared error drops, so no group is worse, and on random weights most are better."""
    torch.manual_seed(0)
    weight = torch.cat([torch.randn(48, 64), torch.distributions.StudentT(3.0).sample((48, 64))])
    layer = int4_linear(weight)
    groups = weight.reshape(96, 2, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / 15).to(torch.bfloat16).float()  # Q4_1 by hand, scale and zero rounded as the kernel's
    zero = (low + 8 * step).to(torch.bfloat16).float()
    min_max = (torch.round((groups - zero) / step + 8).clamp(0, 15) - 8) * step + zero
    mine = layer.dequantized().reshape(96, 2, 32)
    worse = ((mine - groups) ** 2).sum(-1) - ((min_max - groups) ** 2).sum(-1)
    assert (worse <= 1e-6).all()
    assert (worse < -1e-6).float().mean() > 0.5 and ((mine - groups) ** 2).sum() < 0.95 * ((min_max - groups) ** 2).sum()
    levels = torch.arange(32.0).remainder(16) * 0.25 - 1.0  # values already on a 16-level grid come back as they are
    exact = int4_linear(levels.repeat(16, 1))
    assert torch.equal(exact.dequantized(), levels.repeat(16, 1))
    constant = int4_linear(torch.full((16, 32), 0.375))  # one code per group: no fit, the value itself
    assert torch.equal(constant.dequantized(), torch.full((16, 32), 0.375))  # (0.375 is exact in bfloat16)
    inexact = int4_linear(torch.full((16, 32), 0.1)).dequantized()  # not exact in bfloat16: its zero is 0.1 rounded
    assert torch.equal(inexact, torch.full((16, 32), torch.tensor(0.1).to(torch.bfloat16).item()))
    with pytest.raises(ValueError, match=r"multiples of \(16, 32\), got \(8, 32\)"):
        int4_linear(torch.zeros(8, 32))


def _saved_head(tmp_path, draft_vocab: int = 80):
    head = random_head("tiny-q4", "tiny-head", seed=3, draft_vocab=draft_vocab)
    head.save(tmp_path / "head")
    return str(tmp_path / "head")


@pytest.mark.parametrize("method", ["linear", "fixed-tree", "dynatree", "specinfer", "wetap"])
def test_a_feature_head_drafts_in_4_bits_for_a_q4_target_and_greedy_output_stays_ar(tmp_path, method):
    """On a q4 target a head's decoder layer and its sub-vocabulary's output rows run on the int4
    kernel (featurehead.to_q4); its proposals change, the committed tokens do not."""
    target = _low_bit_target("q4", 0)
    spec = _saved_head(tmp_path)
    draft = load_draft(spec, target)
    head = draft.model
    assert head.weights == "q4"
    assert [type(m) for m in head.body.modules() if isinstance(m, (Int4Linear, torch.nn.Linear))] == [Int4Linear] * 7
    assert isinstance(FeatureDrafter(head, target).out, Int4Linear)
    for prompt in ([5, 6, 7, 5, 6, 7, 30], [9, 40, 41, 12, 3], [3, 4, 5, 6, 3, 4]):
        ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=20, ignore_eos=True)
        for d in (draft, load_draft(f"ngram+{spec}", target)) if method == "dynatree" else (draft,):
            out = generate(method=method, target=target, draft=d, prompt_ids=prompt, max_new_tokens=20,
                           ignore_eos=True, **({"cost_aware": True} if method == "dynatree" else {}))
            assert out.new_token_ids == ar.new_token_ids, (prompt, d.name)
            assert out.run.draft_weights == "q4" and out.stats.drafted_tokens > 0


def test_a_head_stays_dense_where_the_target_is_or_its_shapes_do_not_fit_the_int4_kernel(tmp_path):
    target = _low_bit_target("q4", 0)
    misfit = _saved_head(tmp_path, draft_vocab=72)  # 72 output rows: not a multiple of 16
    head = load_draft(misfit, target).model
    assert head.weights == "dense" and not [m for m in head.modules() if isinstance(m, Int4Linear)]
    out = generate(method="dynatree", target=target, draft=head, prompt_ids=[5, 6, 7, 5], max_new_tokens=4)
    assert out.run.draft_weights == "dense"
    with pytest.raises(DynaTreeError, match=r"^feature head 'x' cannot run in 4 bits: .* sub-vocabulary 72$"):
        load_head(misfit, name="x", dtype=torch.bfloat16, weights="q4")
    with pytest.raises(DynaTreeError, match=r"^a q4 feature head runs in bfloat16 on the CPU"):
        load_head(misfit, dtype=torch.float32, weights="q4")
    with pytest.raises(DynaTreeError, match=r"^a feature head's weights are dense or q4, got 'int8'$"):
        load_head(misfit, dtype=torch.bfloat16, weights="int8")
    packed = load_head(_saved_head(tmp_path / "packed"), dtype=torch.bfloat16, linear="auto")
    if linear_kernel(packed) == "onednn":  # to_q4 on a head whose linears are packed already
        with pytest.raises(DynaTreeError, match=r"quantize it before packing"):
            packed.to_q4()
        assert packed.weights == "dense"
    with pytest.raises(DynaTreeError, match=r"^a q4 feature head runs in bfloat16 on the CPU .*float16"):
        load_head(_saved_head(tmp_path / "half"), dtype=torch.float16).to_q4()
    with pytest.raises(DynaTreeError, match=r"^a q4 feature head runs in bfloat16 on the CPU \(.*\), not torch.float32 on meta$"):
        load_head(_saved_head(tmp_path / "meta"), dtype=torch.float32).to("meta").to_q4()
    quantized = load_head(_saved_head(tmp_path / "fit"), dtype=torch.bfloat16, weights="q4")
    by_hand = load_head(_saved_head(tmp_path / "fit"), dtype=torch.float32)  # to_q4 quantizes the float32 weights
    by_hand.to_q4()
    assert by_hand.weights == "q4" and by_hand.fc.weight.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(quantized.state_dict().values(), by_hand.state_dict().values()))
    dense = load_head(_saved_head(tmp_path / "fit"), dtype=torch.float32)  # ... from float32, not bfloat16
    layer = next(name for name, m in by_hand.named_modules() if isinstance(m, Int4Linear))
    weight = dense.get_submodule(layer).weight.detach()
    assert torch.equal(by_hand.get_submodule(layer).dequantized(), int4_linear(weight).dequantized())
    assert not torch.equal(int4_linear(weight).dequantized(), int4_linear(weight.bfloat16()).dequantized())
    with pytest.raises(ValueError, match=r"holds quantized codes"):
        quantized.save(tmp_path / "again")
    for move in (lambda h: h.float(), lambda h: h.to(torch.float16), lambda h: h.to("meta")):
        with pytest.raises(DynaTreeError, match=r"^a q4 feature head runs in bfloat16 on the CPU"):
            move(quantized)
    assert quantized.to("cpu").fc.weight.dtype == torch.bfloat16  # where it is already: fine
    dense_target = _low_bit_target("int8", 0)  # not q4: the head keeps its dense layers
    assert load_draft(_saved_head(tmp_path / "int8"), dense_target).model.weights == "dense"


@pytest.mark.slow
def test_a_compiled_q4_head_builds_its_graphs_before_the_clock_and_keeps_compiled_ars_tokens(tmp_path):
    target = _low_bit_target("q4", 1)
    spec = f"ngram+{_saved_head(tmp_path)}"
    prompt = [5, 9, 14, 9, 5, 9, 14, 30, 7, 5, 9]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=24, ignore_eos=True, compile=True)
    out = generate(method="dynatree", target=target, draft=spec, prompt_ids=prompt, max_new_tokens=24,
                   ignore_eos=True, compile=True)
    assert out.run.draft_weights == "q4" and out.stats.drafted_tokens > 0
    assert out.stats.graphs_compiled_while_timed == 0
    assert out.new_token_ids == ar.new_token_ids


def test_int4_linear_refuses_a_weight_with_non_finite_values():
    from dynatree.weights import int4_linear

    weight = torch.randn(16, 64)
    weight[3, 5] = float("nan")
    weight[7, 9] = float("inf")
    with pytest.raises(ValueError, match="holds 2 non-finite values"):
        int4_linear(weight)
