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

# The embedded models: the full training recipe (about 2 hours on 2 CPU cores).
# The drafter is pre-trained on the corpus, the target trained, then the drafter is distilled
# from the target (it learns the target's next-token distributions, which is what verification
# checks) and converted to block diffusion, again distilled. Each stage is a file target, so an
# interrupted `make models` continues where it stopped (`--resume`).
# Intermediate outputs go to runs/; `make ship-models` copies the results into the package.
RUNS ?= runs
TRAIN := $(VENV)/bin/failfast train
COMMON := --data $(RUNS)/data --batch-size 16 --seq-len 256 --resume

models: $(RUNS)/drafter-dllm/training.json

$(RUNS)/data/manifest.json: | venv
	$(TRAIN) data --out $(RUNS)/data

$(RUNS)/drafter-ar-base/training.json: $(RUNS)/data/manifest.json
	$(TRAIN) ar --size drafter --out $(RUNS)/drafter-ar-base --steps 1000 --lr 2e-3 $(COMMON)

$(RUNS)/target/training.json: $(RUNS)/data/manifest.json
	$(TRAIN) ar --size target --out $(RUNS)/target --steps 600 --lr 2e-3 $(COMMON)

$(RUNS)/drafter-ar/training.json: $(RUNS)/drafter-ar-base/training.json $(RUNS)/target/training.json
	$(TRAIN) ar --init $(RUNS)/drafter-ar-base --teacher $(RUNS)/target --out $(RUNS)/drafter-ar --steps 300 --lr 1e-3 $(COMMON)

$(RUNS)/drafter-dllm/training.json: $(RUNS)/drafter-ar/training.json
	$(TRAIN) diffusion --init $(RUNS)/drafter-ar --teacher $(RUNS)/target --out $(RUNS)/drafter-dllm --steps 150 --lr 1e-3 --block-size 32 --sub-block-size 8 $(COMMON)

# Copy the trained models into the package with model cards (after `make models`).
ship-models: venv
	$(PY) scripts/ship_models.py --runs $(RUNS)
	$(PY) scripts/evaluate_embedded.py --out $(RUNS)/evaluation.json
	$(PY) scripts/ship_models.py --runs $(RUNS) --evaluation $(RUNS)/evaluation.json

# The main job on the embedded default: complete a prompt, print FailFast's live speedup.
demo: venv
	$(VENV)/bin/failfast demo
