# torchaxe: `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchaxe-installed

.PHONY: demo test bench clean setup

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/torchaxe scan --target npu examples/ ; test $$? -le 1
	@echo
	@echo "Preview of every fix (safe and unsafe) for a CPU target on the GPT example; nothing is written:"
	$(BIN)/torchaxe fix --diff --unsafe-fixes --target cpu examples/gpt/train.py ; test $$? -le 1

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto

bench: $(STAMP)
	-$(BIN)/python benchmarks/scan_speed.py
	-$(BIN)/python benchmarks/harness_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
