# planc — the two commands of the README's quick start: `make demo`, `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
PLANC  := $(VENV)/bin/planc
DEMO_PLAN ?= plans/gpt-2x4.plan
DEMO_OUT  ?= build/demo

.PHONY: install demo test clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch where a local wheel exists; GPU users keep their own torch>=2.4
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"
	# DeepSpeed JIT-builds its CPU shared-memory op the first time a rank starts (~50 s): build it here,
	# once, into the venv, where the tests keep it (tests/conftest.py); a machine without a C++
	# compiler skips this and pays the build (or its error) at the first launch instead
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$(abspath $(VENV))/torch_extensions" $(PY) -c \
	  "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()" \
	  >/dev/null 2>&1 || echo "note: DeepSpeed's CPU op was not prebuilt; the first launch builds it"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PLANC) compile $(DEMO_PLAN) -o $(DEMO_OUT)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash $(DEMO_OUT)/launch.sh

test: install
	# two workers, long files first (tests/conftest.py), the 30 slowest tests listed at the end of every run
	$(PY) -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider --durations=30

clean:
	rm -rf $(VENV) build
