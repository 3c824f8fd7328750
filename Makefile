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
	touch $@

install: $(VENV)/.installed

demo: install
	$(PLANC) compile $(DEMO_PLAN) -o $(DEMO_OUT)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash $(DEMO_OUT)/launch.sh

test: install
	$(PY) -m pytest -n 2 -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build
