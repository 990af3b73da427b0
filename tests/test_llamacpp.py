"""llamacpp-ar: llama.cpp on the target's GGUF file, the CPU user's alternative, as a baseline method."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dynatree import generate
from dynatree.errors import DynaTreeError
from dynatree.runtime import LoadedModel
from helpers import tiny


def test_llamacpp_needs_a_target_loaded_from_a_gguf_file():
    with pytest.raises(DynaTreeError, match=r"^llamacpp-ar runs llama\.cpp on the target's GGUF file; 'tiny-llama-0' "
                                            r"was not loaded from one \(use the embedded model or a \.gguf path\)$"):
        generate(method="llamacpp-ar", target=tiny("llama"), prompt_ids=[5, 6], max_new_tokens=2)


def _gguf_tiny() -> LoadedModel:
    base = tiny("llama")
    return LoadedModel(model=base.model, tokenizer=base.tokenizer, name="tiny.gguf", gguf=Path("/nonexistent/tiny.gguf"))


@pytest.mark.parametrize("kwargs,message", [
    ({"sample": True}, r"llamacpp-ar decodes greedily only .* drop --sample"),
    ({"compile": True}, r"compile \(--compile\) does not apply to 'llamacpp-ar': llama\.cpp runs its own native "
                        r"kernels"),
    ({"kv_window": "4,8"}, r"kv_window \(--kv-window\) is not available for 'llamacpp-ar' \(llama\.cpp's own decoding\)"),
    ({"max_new_tokens": 600}, r"prompt \(2 tokens\) \+ max_new_tokens \(600\) exceeds the context length 512"),
    ({"draft": "ngram"}, r"draft \(--draft\) does not apply to 'llamacpp-ar'"),
])
def test_what_llamacpp_cannot_run_is_a_one_line_error(kwargs, message):
    with pytest.raises(DynaTreeError, match=message):
        generate(method="llamacpp-ar", target=_gguf_tiny(), prompt_ids=[5, 6], **{"max_new_tokens": 2, **kwargs})


def test_without_the_binding_llamacpp_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(DynaTreeError, match=r"^llamacpp-ar and llamacpp-lookup need the llama-cpp-python package: "
                                            r"pip install llama-cpp-python"):
        generate(method="llamacpp-ar", target=_gguf_tiny(), prompt_ids=[5, 6], max_new_tokens=2)


@pytest.mark.slow
def test_llamacpp_decodes_the_embedded_gguf_greedily():
    pytest.importorskip("llama_cpp")  # an optional extra (pip install llama-cpp-python); the errors above always run
    from dynatree.models import load_model

    target = load_model("smollm2-135m", weights="q4")
    question = "What is the capital of France? Answer in one sentence."
    ours = generate(question, "ar", target=target, chat=True, max_new_tokens=12, ignore_eos=True)
    theirs = generate(question, "llamacpp-ar", target=target, chat=True, max_new_tokens=12, ignore_eos=True)
    assert len(theirs.new_token_ids) == 12 and theirs.stats.iterations == 12
    assert theirs.run.engine == "llama.cpp" and theirs.run.weights == "GGUF Q4_1 x210, Q8_0 (token_embd.weight)"
    assert "Paris" in theirs.text and "Paris" in ours.text
    assert theirs.new_token_ids[:3] == ours.new_token_ids[:3]  # the same model, decoded by another engine
    again = generate(question, "llamacpp-ar", target=target, chat=True, max_new_tokens=12, ignore_eos=True)
    assert again.new_token_ids == theirs.new_token_ids  # each run starts from an empty cache
    cut = generate(question, "llamacpp-ar", target=target, chat=True, max_new_tokens=12, ignore_eos=True, stop="Paris")
    assert cut.text == theirs.text[:theirs.text.find("Paris")] and cut.finish_reason == "stop"
    assert cut.stats.new_tokens == len(cut.new_token_ids) < 12  # llama.cpp's loop ended at the stop string


@pytest.mark.parametrize("kwargs,message", [
    ({"sample": True}, r"^llamacpp-lookup decodes greedily only"),
    ({"prompt_lookup_num_tokens": 0}, r"^prompt_lookup_num_tokens must be at least 1, got 0"),
    ({"draft": "ngram"}, r"draft \(--draft\) does not apply to 'llamacpp-lookup'"),
])
def test_llamacpp_lookup_refuses_what_it_cannot_run(kwargs, message):
    with pytest.raises(DynaTreeError, match=message):
        generate(method="llamacpp-lookup", target=_gguf_tiny(), prompt_ids=[5, 6], **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(DynaTreeError, match=r"^llamacpp-lookup runs llama\.cpp on the target's GGUF file"):
        generate(method="llamacpp-lookup", target=tiny("llama"), prompt_ids=[5, 6], max_new_tokens=2)


@pytest.mark.slow
def test_llamacpp_lookup_is_llama_cpps_own_speculative_mode_with_its_passes_counted():
    """llama.cpp's prompt-lookup decoding (the binding's speculative mode) on a prompt that repeats
    itself: the same tokens as llama.cpp's one-token greedy decoding, in fewer passes, its drafts counted."""
    pytest.importorskip("llama_cpp")
    from dynatree.models import load_model

    target = load_model("smollm2-135m", weights="q4")
    text = "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape."
    plain = generate(text, "llamacpp-ar", target=target, chat=True, max_new_tokens=48, ignore_eos=True)
    fast = generate(text, "llamacpp-lookup", target=target, chat=True, max_new_tokens=48, ignore_eos=True)
    assert fast.new_token_ids == plain.new_token_ids and fast.run.engine == "llama.cpp"
    assert fast.stats.iterations < 48 and fast.stats.drafted_tokens > 0 and fast.stats.accepted_tokens > 0
    assert fast.stats.accepted_tokens == 48 - fast.stats.iterations


def test_llamacpp_refuses_runs_longer_than_its_context(monkeypatch):
    from dynatree import llamacpp

    monkeypatch.setattr(llamacpp, "MAX_CONTEXT", 8)
    with pytest.raises(DynaTreeError, match=r"^llamacpp-ar: prompt \(2 tokens\) \+ max_new_tokens \(7\) exceeds the "
                                            r"8 tokens of llama\.cpp's context here$"):
        generate(method="llamacpp-ar", target=_gguf_tiny(), prompt_ids=[5, 6], max_new_tokens=7)


def test_llamacpp_rows_are_labelled_with_the_quantized_format_they_read():
    """llama.cpp reads the GGUF file's own 4-bit matrices: its run records and its bench rows name
    the storage types, so it is never mistaken for a float32 comparison."""
    from dynatree.bench import report, results
    from dynatree.embedded import DEFAULT_TARGET, EMBEDDED
    from dynatree.llamacpp import gguf_format
    from dynatree.models import _embedded_gguf

    label = gguf_format(_embedded_gguf(EMBEDDED[DEFAULT_TARGET]))
    assert label == "GGUF Q4_1 x210, Q8_0 (token_embd.weight)"
    stats = {k: 1.0 for k in results.STATS}
    records = [{"variant": v, "method": v, "draft": None, "prompt_index": 0, "warmup": False, "max_new_tokens": 8,
                "l_max": 800, "prompt_tokens": 5, "stats": stats, "matches_ar": True, "weights": w}
               for v, w in (("ar", "dense"), ("llamacpp-ar", label))]
    table = report.main_tables(results.aggregate(records))
    assert f"| llamacpp-ar ({label}) |" in table and "| ar | - |" in table


def _binding_that_imports(monkeypatch, probe: str) -> None:
    """llama_cpp importable here (a stand-in module: nothing may load a model in-process) and the
    child process of `llamacpp.ready` replaced by `probe`, nothing probed yet."""
    import types

    from dynatree import llamacpp

    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setattr(llamacpp, "PROBE", probe)
    monkeypatch.setattr(llamacpp, "_READY", {})


NO_CORE = "import os, resource, signal, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
CRASH = NO_CORE + "os.kill(os.getpid(), signal.SIGSEGV)"


@pytest.mark.parametrize("amx", [True, False])
def test_a_binding_that_crashes_is_refused_before_it_decodes_in_this_process(monkeypatch, amx):
    """A llama.cpp build that crashes (a native build on Intel Xeons with AMX does, in its AMX
    kernels) would kill the process running it: a child process decodes first, and its crash is a
    one-line error; on an AMX CPU it says how to rebuild the binding without those kernels."""
    from dynatree import llamacpp

    _binding_that_imports(monkeypatch, CRASH)
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: {"avx512f", "amx_int8"} if amx else {"avx2"})
    start = (r"^llama\.cpp crashed \(SIGSEGV\) decoding a short prompt of tiny\.gguf in a child process, so "
             r"llamacpp-ar/llamacpp-lookup cannot run in this one")
    hint = (r"; on Intel CPUs with AMX this is a known crash of llama\.cpp's AMX kernels \(ggml-org/llama\.cpp#20824\): "
            r"rebuild the binding without them: " + re.escape(llamacpp.REBUILD) + "$")
    assert "-DGGML_NATIVE=OFF" in llamacpp.REBUILD and "-DGGML_AMX_INT8=OFF" in llamacpp.REBUILD
    for method in ("llamacpp-ar", "llamacpp-lookup"):
        with pytest.raises(DynaTreeError, match=start + (hint if amx else "$")):
            generate(method=method, target=_gguf_tiny(), prompt_ids=[5, 6], max_new_tokens=2)


def test_a_binding_that_fails_says_why_and_each_setting_is_probed_once(monkeypatch):
    from dynatree import llamacpp

    tiny_gguf = Path("/nonexistent/tiny.gguf")
    _binding_that_imports(monkeypatch, "raise SystemExit('gguf_init_from_file: failed to read magic')")
    failed = r"^llama\.cpp could not decode a short prompt of tiny\.gguf in a child process: gguf_init_from_file: " \
             r"failed to read magic$"
    with pytest.raises(DynaTreeError, match=failed):
        llamacpp.ready(tiny_gguf, 512, 2)
    monkeypatch.setattr(llamacpp, "PROBE", "pass")
    with pytest.raises(DynaTreeError, match=failed):  # the failure is kept: no new child per request
        llamacpp.ready(tiny_gguf, 512, 2)
    llamacpp.ready(tiny_gguf, 512, 1)  # another thread count: probed, and it decodes
    monkeypatch.setattr(llamacpp, "PROBE", CRASH)
    llamacpp.ready(tiny_gguf, 512, 1)  # not probed again for the same file, context and threads
    with pytest.raises(DynaTreeError, match=r"^llama\.cpp crashed \(SIGSEGV\)"):  # another context is probed
        llamacpp.ready(tiny_gguf, 256, 1)


@pytest.mark.parametrize("probe,how", [
    (NO_CORE + "sys.stderr.write('GGML_ASSERT(n > 0) failed\\n'); sys.stderr.flush(); os.abort()",
     r"SIGABRT\) .* cannot run in this one \(GGML_ASSERT\(n > 0\) failed\)"),
    (NO_CORE + "os.kill(os.getpid(), 40)", r"signal 40\) .* cannot run in this one"),
])
def test_other_crashes_are_named_and_not_blamed_on_amx(monkeypatch, probe, how):
    from dynatree import llamacpp

    _binding_that_imports(monkeypatch, probe)
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: {"avx512f", "amx_int8"})
    with pytest.raises(DynaTreeError, match=r"^llama\.cpp crashed \(" + how + "$"):
        llamacpp.ready(Path("/nonexistent/tiny.gguf"), 512, 2)


def test_a_bench_with_a_crashing_binding_stops_before_its_first_run(monkeypatch, prompt_file):
    from dynatree.bench import presets, runner

    _binding_that_imports(monkeypatch, CRASH)
    ran = []
    monkeypatch.setattr(runner, "run_one", lambda *a, **k: ran.append(a))
    variants = presets.method_variants(["ar", "llamacpp-ar"], ["ngram"])
    proto = runner.Protocol(dataset=str(prompt_file), n=1, warmup=0, max_new_tokens=[4])
    with pytest.raises(DynaTreeError, match=r"^llama\.cpp crashed \(SIGSEGV\)"):
        runner.run("perf", variants, proto, _gguf_tiny(), {}, progress=False)
    assert ran == []
