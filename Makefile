# Every target sets itself up: a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   ?= demo_out
# Pinned CPU torch first: a bare `torch` requirement would pull the newest CUDA build (several GB).
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: setup test lint typecheck demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[dev,ray]"  # the Ray engine's tests run in `make test`
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(PY) -m pipelines.demo --out $(DEMO)

bench: $(STAMP)
	$(PIP) -e ".[bench]"  # Hugging Face's RoFormer, the scoring benchmark's reference
	$(PY) benchmarks/etl_throughput.py
	$(PY) benchmarks/predict_throughput.py --patients 10000 --baseline-patients 2000

clean:
	rm -rf $(VENV) $(DEMO) .mypy_cache .ruff_cache
