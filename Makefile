# `make test` builds a fresh virtual environment (CPU PyTorch) and runs the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv test clean models ship-models demo

$(VENV)/.installed: pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first, so that no CUDA build is pulled in as a dependency.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# The embedded models: the full training recipe (about 90 minutes on 2 CPU cores).
# Intermediate outputs go to runs/; `make ship-models` copies the results into the package.
RUNS ?= runs
TRAIN := $(VENV)/bin/failfast train

models: venv
	$(TRAIN) data --out $(RUNS)/data
	$(TRAIN) ar --size drafter --data $(RUNS)/data --out $(RUNS)/drafter-ar --steps 1000 --batch-size 16 --seq-len 256 --lr 2e-3 --resume
	$(TRAIN) diffusion --init $(RUNS)/drafter-ar --data $(RUNS)/data --out $(RUNS)/drafter-dllm --steps 300 --batch-size 16 --seq-len 256 --lr 1e-3 --block-size 32 --sub-block-size 8 --resume
	$(TRAIN) ar --size target --data $(RUNS)/data --out $(RUNS)/target --steps 1400 --batch-size 8 --seq-len 256 --lr 1.5e-3 --resume

# Copy the trained models into the package with model cards (after `make models`).
ship-models: venv
	$(PY) scripts/ship_models.py --runs $(RUNS)
	$(PY) scripts/evaluate_embedded.py --out $(RUNS)/evaluation.json
	$(PY) scripts/ship_models.py --runs $(RUNS) --evaluation $(RUNS)/evaluation.json

# The main job on the embedded default: complete a prompt, print FailFast's live speedup.
demo: venv
	$(VENV)/bin/failfast demo
