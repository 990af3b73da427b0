"""Fixtures shared by the tests; the helpers they use live in `helpers.py` (imported as a module)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import PROFILE, tiny


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on (Linux)
    except AttributeError:  # elsewhere
        return os.cpu_count() or 1


def _share_the_cores() -> None:
    """Under pytest-xdist (`make test` runs one worker per core) each worker's torch, and the
    subprocesses its tests start (OMP_NUM_THREADS), get an equal share of the cores rather than all
    of them each: workers that each ran a thread per core would contend for every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, _cores() // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_the_cores()


def pytest_collection_modifyitems(config, items):
    """The dev profile (`make test-fast`) deselects the tests marked slow."""
    if PROFILE != "dev":
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True)
def inductor_runtime_asserts_on(monkeypatch):
    """Compiled graphs keep inductor's runtime asserts in tests (shipped graphs leave them out:
    runtime.no_runtime_asserts): a fake kernel's shape or stride that disagrees with the real one (the
    packed linears' custom op) then fails loudly here instead of computing on. They change no value;
    test_compile.py checks the shipped options apart."""
    from dynatree import runtime

    monkeypatch.setattr(runtime, "no_runtime_asserts", lambda: {})


@pytest.fixture(autouse=True)
def layer_checks_as_shipped():
    """No test leaves the process keeping every layer's shape checks (runtime.note_layers): a model of the
    suite whose layers differ would otherwise switch them on for every later test, unnoticed."""
    from dynatree import runtime

    yield
    left_on = runtime._every_layer_check
    runtime.keep_every_layer_check(False)  # (one failure, not one per later test)
    assert not left_on, "a test loaded a model whose layers differ and left every check on"


@pytest.fixture(scope="session")
def saved_tiny(tmp_path_factory):
    """A tiny Llama saved as a checkpoint directory, for CLI and loader tests."""
    path = tmp_path_factory.mktemp("tiny-llama")
    m = tiny("llama", seed=3, dtype=torch.float32, context=64)
    m.model.save_pretrained(path)
    m.tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def prompt_file(tmp_path):
    """Four short word-level prompts as a JSONL data set, for bench runs on tiny models."""
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in
                           ["w5 w6 w7 w5 w6 w7", "w10 w11 w12 w10 w11", "w40 w41 w40 w41 w40", "w9 w9 w9"]))
    return f
