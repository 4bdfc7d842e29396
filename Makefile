# Environment and entry points. `make demo` and `make test` create .venv (Python 3.12) on first use.
SHELL := /bin/bash
PYTHON312 := $(shell python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Torch/TorchDynamo compile nothing useful for tiny CPU models; skipping it saves seconds per process.
export TORCHDYNAMO_DISABLE := 1

.PHONY: venv demo test clean

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m toolkits.demo

# The lint step first (ruff, configured in pyproject.toml); pytest exits 5 when it collected nothing: that
# is a failure here, not a pass.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) demo_out
