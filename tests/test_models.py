"""Model loading helpers: causality probe, vocabulary check, dtype/device errors."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from helpers import tiny, tokenizer
from dynatree import DynaTreeError, LoadedModel, load_model
from dynatree.models import check_causal, check_compatible, resolve_device, same_device


def test_causality_probe_rejects_bidirectional_attention():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     initializer_range=0.3)
    encoder = LoadedModel(model=BertForMaskedLM(cfg).eval(), tokenizer=tokenizer(), name="bert")
    with pytest.raises(DynaTreeError, match="attends to future tokens"):
        check_causal(encoder)
    check_causal(tiny("gpt2"))  # a causal LM passes


def test_vocabulary_check():
    check_compatible(tiny("llama"), tiny("gpt2", seed=5))  # same tokenizer, other architecture: fine
    with pytest.raises(DynaTreeError, match=r"different vocabularies \(80 vs 96 tokens: 0 only in the draft's, 16 only "
                                            r"in the target's, 0 at other ids\)"):
        check_compatible(tiny("llama"), tiny("gpt2", vocab=80))


def test_load_saved_directory(saved_tiny, capfd):
    m = load_model(str(saved_tiny), dtype="float64")
    assert "Loading weights" not in capfd.readouterr().err  # no transformers progress bar from the API (issue 37)
    assert m.dtype == torch.float64 and m.context_length == 64 and m.eos_ids == [2]
    assert m.vocab_size == 96


def test_directory_without_config(tmp_path):
    with pytest.raises(DynaTreeError, match="no config.json"):
        load_model(str(tmp_path))


def test_directory_without_tokenizer_files(saved_tiny, tmp_path):
    """A checkpoint saved without its tokenizer is named as such, before its weights load (transformers'
    own message, "Couldn't instantiate the backend tokenizer from one of:", says neither)."""
    import shutil

    for name in ("config.json", "model.safetensors"):
        shutil.copy(saved_tiny / name, tmp_path / name)
    with pytest.raises(DynaTreeError, match=r"has no tokenizer files \(none of tokenizer.json, .*\): save the tokenizer "
                                            r"beside the model"):
        load_model(str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(DynaTreeError, match="CUDA is not available"):
        resolve_device("cuda")


def test_other_accelerators_are_refused_in_one_line():
    """Timings and memory figures synchronise and read CUDA only: another device type is refused."""
    for name in ("mps", "xpu"):
        with pytest.raises(DynaTreeError, match=f"device '{name}' is not supported; choose cpu, cuda"):
            resolve_device(name)
    for name in ("tpu", "cuda:x"):  # not torch device names: the same choices, not torch's own list
        with pytest.raises(DynaTreeError, match=f"^unknown device '{name}'; choose cpu, cuda, cuda:N or auto$"):
            resolve_device(name)


def test_a_model_on_cuda_0_is_where_cuda_says():
    """A parameter's device carries its index (cuda:0) while a user writes 'cuda' or 'auto': the API
    must not refuse a loaded target for that (found by a read of the CUDA path)."""
    cuda0, cuda1, cpu = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")
    assert same_device(cpu, cpu) and not same_device(cpu, cuda0) and not same_device(cuda0, cpu)
    assert same_device(cuda0, cuda0) and not same_device(cuda1, cuda0)
    if torch.cuda.is_available():  # 'cuda' alone is the current device
        here = torch.device("cuda", torch.cuda.current_device())
        assert same_device(torch.device("cuda"), here)


def test_a_loaded_models_repr_is_one_line_naming_it():
    """Printed whole, the module tree and the tokenizer's added tokens ran to about 60 lines."""
    text = repr(tiny("llama"))
    assert text.startswith("LoadedModel(name='tiny-llama-0'") and "\n" not in text and "weights='dense'" in text


def test_the_context_length_is_read_from_each_configs_own_field():
    """MPT names its limit max_seq_len; BLOOM (ALiBi positions) names none: None, and no length refused."""
    from transformers import BloomConfig, BloomForCausalLM, MptConfig, MptForCausalLM

    mpt = MptForCausalLM(MptConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=96, max_seq_len=48))
    bloom = BloomForCausalLM(BloomConfig(hidden_size=32, n_head=4, n_layer=1, vocab_size=96))
    assert LoadedModel(model=mpt, tokenizer=tokenizer(), name="mpt").context_length == 48
    assert LoadedModel(model=bloom, tokenizer=tokenizer(), name="bloom").context_length is None
