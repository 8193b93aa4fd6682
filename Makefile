# The README's commands. Each target builds the local virtual environment it needs (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
RUNS ?= runs/demo

.PHONY: demo test lint bench venv clean

venv: $(VENV)/.installed

# torch is pinned first so that the package's own torch range is already satisfied by the CPU wheel on disk.
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,demo]'
	touch $@

demo: venv
	$(OFFLINE) $(PY) analyze.py outliers --output_dir $(RUNS)/minilm-outliers

test: venv
	$(OFFLINE) $(PY) -m pytest -q

lint: venv
	$(PY) -m ruff check .

bench: venv
	$(OFFLINE) $(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs *.egg-info
