# Environment and entry points. `make demo` and `make test` create .venv (Python 3.12) on first use.
SHELL := /bin/bash
PYTHON312 := $(shell python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python3)
# The megatron-core releases we test (megatron_patch/compat.py's TESTED; docs/upgrading.md): the newest supported
# in .venv (`make test`), the oldest in .venv-oldest (`make test-oldest`); .ci/run runs both.
MCORE_NEWEST := 0.19.2
MCORE_OLDEST := 0.18.2
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OLD_VENV := .venv-oldest
OLD_PY := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.installed
# Under the oldest release, a reduced suite: every unit, parity and layout test, conversion round trips
# through every format and the converter CLI, generation on both engines, pretraining (save, resume,
# --load-hf) and megatron.training loading our checkpoints.
OLDEST_TESTS := tests/unit tests/parity tests/distributed tests/e2e/test_formats.py tests/e2e/test_cli.py \
	tests/e2e/test_generate.py tests/e2e/test_pretrain.py tests/e2e/test_megatron_training_load.py
# Torch/TorchDynamo compile nothing useful for tiny CPU models; skipping it saves seconds per process.
export TORCHDYNAMO_DISABLE := 1

.PHONY: venv venv-oldest demo test test-oldest clean

venv: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' 'megatron-core==$(MCORE_NEWEST)'
	touch $(STAMP)

venv-oldest: $(OLD_STAMP)

# Layered on .venv: a .pth file puts .venv's site-packages after its own, so torch (several GB, a CUDA build from
# PyPI) and everything else the two releases share are installed once; pip installs here only what differs
# (megatron-core $(MCORE_OLDEST) and any dependency it pins otherwise), and that shadows .venv's copy. Two full
# environments did not fit a CI machine's disk (pip: "No space left on device").
$(OLD_STAMP): setup.py Makefile $(STAMP)
	test -x $(OLD_PY) || $(PYTHON312) -m venv $(OLD_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(OLD_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_layer_on_venv.pth"
	$(OLD_PY) -m pip install -q --upgrade pip
	$(OLD_PY) -m pip install -q -e '.[test]' 'megatron-core==$(MCORE_OLDEST)'
	$(OLD_PY) -c 'import importlib.metadata as m, sys; v = m.version("megatron-core"); sys.exit(0 if v == "$(MCORE_OLDEST)" else f"error: .venv-oldest finds megatron-core {v}, not $(MCORE_OLDEST)")'
	touch $(OLD_STAMP)

demo: $(STAMP)
	$(PY) -m toolkits.demo

# The lint step first (ruff, configured in pyproject.toml); pytest exits 5 when it collected nothing: that
# is a failure here, not a pass. The 15 slowest tests are listed at the end (where the suite's time goes).
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=15 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The oldest supported megatron-core, on the reduced suite above (OLDEST_TESTS; the lint step is `make test`'s).
test-oldest: $(OLD_STAMP)
	$(OLD_PY) -m pytest -q $(OLDEST_TESTS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-oldest: pytest collected no tests" >&2; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) $(OLD_VENV) demo_out
