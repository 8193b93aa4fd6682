# The README's commands. Each target builds the local virtual environment it needs (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
RUNS ?= runs/demo

.PHONY: demo demo-pretrain study study-bb test lint bench venv clean

venv: $(VENV)/.installed

# torch is pinned first so that the package's own torch range is already satisfied by the CPU wheel on disk.
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq torch==2.13.0
	$(PY) -m pip install -qq -e '.[dev,demo]'
	touch $@

# The main job on the embedded defaults: the outlier analysis of the packaged MiniLM on the bundled corpus; the
# LayerNorm weights of its persistent outlier dims zeroed inside the forward pass, against the same on 10 random sets
# of non-outlier dims (Kovaleva et al. 2021; p-values, docs/interventions.md); then the tiny PE / no-PE pretraining
# comparison below (about 4 minutes on 2 idle CPU cores in all, set-up included).
demo: venv
	$(OFFLINE) $(PY) analyze.py outliers --output_dir $(RUNS)/minilm-outliers
	$(OFFLINE) $(PY) analyze.py intervene --interventions layernorm_zero --controls 10 --max_sentences 500 --output_dir $(RUNS)/minilm-intervene --no_progress
	$(MAKE) --no-print-directory demo-pretrain RUNS=$(RUNS)

# Train configs/pretrain/tiny.yaml with and without positional embeddings (CPU, bundled corpus), then the outlier
# analysis of both exports, side by side, then the position probe of both (special tokens excluded: <s> and </s> give
# their positions away by identity): one run each, a demonstration, not a verdict (make study-bb). --ckpt_path last
# makes a re-run resume (or just re-export) a finished run.
demo-pretrain: venv
	$(OFFLINE) $(PY) train.py fit --config configs/pretrain/tiny.yaml --trainer.default_root_dir $(RUNS)/tiny-pe --ckpt_path last
	$(OFFLINE) $(PY) train.py fit --config configs/pretrain/tiny.yaml --model.position_embeddings false --trainer.default_root_dir $(RUNS)/tiny-nope --ckpt_path last
	$(OFFLINE) $(PY) analyze.py outliers --encoder $(RUNS)/tiny-pe --output_dir $(RUNS)/tiny-pe/outliers --no_progress
	$(OFFLINE) $(PY) analyze.py outliers --encoder $(RUNS)/tiny-nope --output_dir $(RUNS)/tiny-nope/outliers --no_progress
	$(PY) analyze.py compare $(RUNS)/tiny-pe/outliers/outliers.json $(RUNS)/tiny-nope/outliers/outliers.json
	@echo "note: what removing the positional embeddings changes shows in the position probes below (position information is gone without them). The share rule above, read alone, cannot tell an outlier from noise or from a collapsed model at this size: the study's seeds and null do (make study-bb, docs/study.md)"
	$(OFFLINE) $(PY) probe.py fit --config configs/probe/position.yaml --model.encoder $(RUNS)/tiny-pe --data.source core/corpus/austen.txt --data.max_sentences 1000 --data.exclude_special true --data.progress false --trainer.enable_progress_bar false --trainer.logger false --trainer.default_root_dir $(RUNS)/tiny-pe/position-probe
	$(OFFLINE) $(PY) probe.py fit --config configs/probe/position.yaml --model.encoder $(RUNS)/tiny-nope --data.source core/corpus/austen.txt --data.max_sentences 1000 --data.exclude_special true --data.progress false --trainer.enable_progress_bar false --trainer.logger false --trainer.default_root_dir $(RUNS)/tiny-nope/position-probe

# The outlier-causes study (docs/study.md): baseline, no PE, clipped softmax, gated attention, causal-learned,
# causal-none and mlm-rope, 3 seeds each, on 2 CPU cores, then study.json / study.png with the null and a verdict per
# arm. Re-running skips the finished runs and resumes a stopped one.
study: venv
	$(OFFLINE) $(PY) study.py --config configs/study/study.yaml --output_dir runs/study

# The same seven arms on the Bigram-Backcopy recipe (configs/study/bb.yaml), where the baseline's outliers pass the null
# on 2 CPU cores (docs/study.md): the toy corpus first (seeded), then the study.
study-bb: venv
	test -f runs/bb/corpus.txt || $(PY) scripts/bigram_backcopy.py --output runs/bb/corpus.txt
	$(OFFLINE) $(PY) study.py --config configs/study/study-bb.yaml --output_dir runs/study-bb

# Two pytest workers (pytest-xdist), a file each at a time, one intra-op thread each (tests/conftest.py): on 2 cores
# the suite takes ~7 min on idle cores (measured from a fresh clone). TEST_WORKERS=0 runs it in this process; make test TEST_ARGS='-k probe' etc.
TEST_WORKERS ?= 2
test: venv
	$(OFFLINE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(TEST_ARGS)

lint: venv
	$(PY) -m ruff check .

bench: venv
	$(OFFLINE) $(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs *.egg-info
