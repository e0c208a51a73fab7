# torchaxe: `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The optional-dependency groups `make test` installs: `make test EXTRAS=test,frameworks`
# adds transformers, accelerate and lightning for the framework tests (.ci/run does).
EXTRAS ?= test
BIN := $(VENV)/bin
comma := ,
STAMP := $(VENV)/.torchaxe-installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo test bench clean setup

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

DEMO_BUDGET ?= 4m

demo: $(STAMP)
	@echo "1. What the scanner finds in the bundled examples, for an Ascend NPU target:"
	$(BIN)/torchaxe scan --target npu examples/ ; test $$? -le 1
	@echo
	@echo "2. torchaxe advise on the GPT example: profile it, measure every candidate change on this"
	@echo "   machine (within $(DEMO_BUDGET)), rank them. Nothing of the example is changed."
	$(BIN)/torchaxe advise --budget $(DEMO_BUDGET) --html torchaxe-report.html -- python examples/gpt/train.py
	@echo
	@echo "3. What \`torchaxe apply --unsafe-fixes\` would change (nothing is written):"
	$(BIN)/torchaxe apply --diff --unsafe-fixes
	@echo
	@echo "The HTML report is in torchaxe-report.html; the advice in torchaxe-advice.json."

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto

# The quick benchmarks save their JSON to benchmarks/results/; the table at the top of
# benchmarks/RESULTS.md is then rebuilt from every saved run there.
bench: $(STAMP)
	-$(BIN)/python benchmarks/scan_speed.py --save
	-$(BIN)/python benchmarks/harness_overhead.py --save
	-$(BIN)/python benchmarks/formula_recall.py --save
	$(BIN)/python benchmarks/summary.py --write

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
