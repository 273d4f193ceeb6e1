"""`make images`: the proxy and CPU replica images, built here with podman from deploy/Dockerfile.

    python3 deploy/images.py                 # base, both images, their sizes, a replica's start to ready
    python3 deploy/images.py --no-start      # without starting a replica
    python3 deploy/images.py --check         # nothing built: say what is missing (podman, mmdebstrap, runc)

The base: PYTHON_IMAGE if given; else python:3.11-slim-bookworm from its registry if it answers;
else `localhost/edgechat-base:bookworm`, made here from Debian's own packages (mmdebstrap:
python3, python3-venv, ca-certificates) and imported: no registry needed. The same Dockerfile
either way (--build-arg PYTHON_IMAGE). pip inside the build uses this machine's pip settings
(index, extra indexes, wheel folders, CA; `pip config list`): they are written to a pip.conf
passed as PIP_CONFIG_FILE, and every local path they name is mounted read-only.

Tags are those deploy/k8s/overlays/cpu-demo runs: localhost/edgechat-proxy:VERSION and
localhost/edgechat-replica:VERSION-cpu (VERSION from pyproject.toml).

podman reads deploy/podman/containers.conf (runc, cgroupfs, netavark, no default ulimits)
unless CONTAINERS_CONF names another: on this machine crun refuses its hybrid cgroups and the
default ulimits are refused by setrlimit. Stdlib only: runs with any python3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
REGISTRY_BASE = "docker.io/library/python:3.11-slim-bookworm"
DEBIAN_BASE = "localhost/edgechat-base:bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEBIAN_SOURCES = ("deb http://deb.debian.org/debian bookworm main",
                  "deb http://deb.debian.org/debian bookworm-updates main",
                  "deb http://deb.debian.org/debian-security bookworm-security main")
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "cert", "trusted-host")
PIP_MOUNT = "/run/edgechat-pip"  # where the build sees the pip.conf made here
READY_TIMEOUT_S = 600  # the replica's startupProbe allows as much


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def tags() -> dict[str, str]:
    """Dockerfile target -> the tag the cpu-demo overlay runs."""
    v = version()
    return {"proxy": f"localhost/edgechat-proxy:{v}", "replica-cpu": f"localhost/edgechat-replica:{v}-cpu"}


def podman_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def podman(*args: str, check: bool = True, capture: bool = True, timeout: float | None = None,
           **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=podman_env(), check=check, text=True, timeout=timeout,
                          capture_output=capture, **kw)


HELPER_DIRS = ("/usr/libexec/podman", "/usr/lib/podman", "/usr/local/libexec/podman", "/usr/local/lib/podman")


def missing_tools(base_needed: bool = True) -> list[str]:
    """What this machine lacks to build and run the images and to play the manifests (Debian:
    apt-get install podman runc netavark aardvark-dns iptables mmdebstrap): podman, runc, netavark
    and aardvark-dns (a podman network whose DNS answers the replicas' alias), iptables (netavark
    sets up the bridge with it; without it a container on a network fails to start with
    "netavark: No such file or directory"), and mmdebstrap."""
    tools = ["podman", "runc", "iptables"] + (["mmdebstrap"] if base_needed else [])
    missing = [t for t in tools if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    return missing + [h for h in ("netavark", "aardvark-dns") if not any(Path(d, h).exists() for d in HELPER_DIRS)]


APT = "apt-get install podman runc netavark aardvark-dns iptables mmdebstrap"


# -- the base ----------------------------------------------------------------------------------

def base_image(log=print) -> str:
    """PYTHON_IMAGE, the registry's python image, or the Debian base made here (in that order)."""
    if os.environ.get("PYTHON_IMAGE"):
        return os.environ["PYTHON_IMAGE"]
    if podman("image", "exists", REGISTRY_BASE, check=False).returncode == 0:
        return REGISTRY_BASE
    pulled = podman("pull", "-q", REGISTRY_BASE, check=False, timeout=600)
    if pulled.returncode == 0:
        return REGISTRY_BASE
    reason = (pulled.stderr.strip().splitlines() or ["no answer"])[-1]
    log(f"base: {REGISTRY_BASE} cannot be pulled ({reason[:160]}); using {DEBIAN_BASE}, from Debian's packages")
    if podman("image", "exists", DEBIAN_BASE, check=False).returncode != 0:
        build_debian_base(log)
    return DEBIAN_BASE


def build_debian_base(log=print) -> None:
    """mmdebstrap a minimal bookworm with Python into a tarball; podman import it with a PATH."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgechat-base-") as tmp:
        tar = Path(tmp) / "rootfs.tar"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=" + ",".join(DEBIAN_PACKAGES),
                        "bookworm", str(tar), *DEBIAN_SOURCES], check=True)
        podman("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "--change", 'CMD ["python3"]', str(tar), DEBIAN_BASE)
    log(f"base: {DEBIAN_BASE} built in {time.monotonic() - t0:.0f} s ({size_mb(DEBIAN_BASE):.0f} MB)")


# -- pip inside the build -------------------------------------------------------------------------

def pip_settings() -> dict[str, str]:
    """This machine's pip settings that say where packages come from (environment over files)."""
    venv = ROOT / ".venv" / "bin" / "python"  # the project's pip, else this python's
    r = subprocess.run([str(venv) if venv.exists() else sys.executable, "-m", "pip", "config", "list"],
                       capture_output=True, text=True)
    found: dict[str, tuple[int, str]] = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^(:env:|[\w-]+)\.([\w-]+)='(.*)'$", line)
        if m and m.group(2) in PIP_KEYS:
            rank = 1 if m.group(1) == ":env:" else 0
            if rank >= found.get(m.group(2), (-1, ""))[0]:
                found[m.group(2)] = (rank, m.group(3))
    return {k: v for k, (_, v) in found.items()}


def local_paths(settings: dict[str, str]) -> list[str]:
    """The files and folders on this machine that the settings name (file:// URLs, absolute paths);
    for a local index (a folder named simple) its parent, where its links point."""
    paths = []
    for value in settings.values():
        for word in value.split():
            path = word.removeprefix("file://").rstrip("/")
            if path.startswith("/") and os.path.exists(path):
                paths.append(os.path.dirname(path) if os.path.basename(path) == "simple" else path)
    return sorted(set(paths))


def pip_build_args(tmp: Path) -> list[str]:
    """podman build arguments: a pip.conf holding this machine's settings, and the paths it names."""
    settings = pip_settings()
    if not settings:
        return []
    (tmp / "pip.conf").write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    args = ["--build-arg", f"PIP_CONFIG_FILE={PIP_MOUNT}/pip.conf", "--volume", f"{tmp}:{PIP_MOUNT}:ro"]
    for path in local_paths(settings):
        args += ["--volume", f"{path}:{path}:ro"]
    return args


# -- building -----------------------------------------------------------------------------------

@dataclass
class Built:
    target: str
    tag: str
    seconds: float
    size_mb: float


def size_mb(image: str) -> float:
    return int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()) / 1e6


def build(target: str, base: str, log=print) -> Built:
    tag = tags()[target]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgechat-pip-") as tmp:
        args = ["build", "--format", "docker", "--network", "host", "--layers", "-f", str(DOCKERFILE),
                "--ignorefile", str(DOCKERFILE.with_name("Dockerfile.dockerignore")), "--target", target,
                "--build-arg", f"PYTHON_IMAGE={base}", *pip_build_args(Path(tmp))]
        if os.environ.get("TORCH") and target.startswith("replica"):
            args += ["--build-arg", f"TORCH={os.environ['TORCH']}"]
        log(f"{target}: podman {' '.join(args)} -t {tag} .")
        r = podman(*args, "-t", tag, str(ROOT), check=False, capture=False,
                   stdout=sys.stderr)  # the build's own output goes to stderr; the figures to stdout
    if r.returncode != 0:
        raise RuntimeError(f"{target}: podman build failed ({r.returncode}); its output is above")
    return Built(target, tag, time.monotonic() - t0, size_mb(tag))


def has_torch(tag: str) -> bool:
    r = podman("run", "--rm", "--network", "none", "--no-healthcheck", "--entrypoint", "python", tag, "-c",
               "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)", check=False)
    return r.returncode == 0


# -- a replica's start ---------------------------------------------------------------------------

@dataclass
class Start:
    seconds: float  # from `podman run` returning (the container started) to /healthz 200
    stages: list[str]  # the replica's `stage:` lines
    log: str


def time_replica_start(tag: str) -> Start:
    """Start the replica image alone as the manifests do (read-only root, fresh volumes at ~/.cache
    and /tmp, a secret from the environment), time it to /healthz 200, remove it and its volumes."""
    name = f"edgechat-start-{os.getpid()}"
    podman("run", "-d", "--name", name, "--read-only", "--volume", "/tmp", "--volume", "/home/edgechat/.cache",
           "--no-healthcheck", "--env", "EDGECHAT_REPLICA_SECRET=start-check", tag,
           "--host=0.0.0.0", "--port=8000", "--model=default", "--device=cpu", f"--replica-id={name}")
    t0 = time.monotonic()
    try:
        ip = podman("inspect", "--format", "{{.NetworkSettings.IPAddress}}", name).stdout.strip()
        try:
            seconds = wait_healthz(f"http://{ip}:8000/healthz", READY_TIMEOUT_S, alive=lambda: "running" in podman(
                "inspect", "--format", "{{.State.Status}}", name, check=False).stdout) - t0
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}; its log ends:\n{logs(name)[-3000:]}") from None
        text = logs(name)
    finally:
        podman("rm", "-f", "-v", "-t", "5", name, check=False)
    return Start(seconds, [ln for ln in text.splitlines() if ln.startswith("stage: ")], text)


def logs(container: str) -> str:
    """A container's output, stdout and stderr as they came."""
    return podman("logs", container, check=False, capture=False, stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT).stdout


def wait_healthz(url: str, timeout_s: float, alive=lambda: True) -> float:
    """monotonic() when `url` first answers 200; raises if the deadline passes or `alive()` turns false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic()
        except (urllib.error.URLError, OSError):
            pass
        if not alive():
            raise RuntimeError(f"{url}: the container stopped before it was ready")
        time.sleep(0.2)  # another process: nothing to await but its answers
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deploy/images.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-start", action="store_true", help="do not time a replica's start")
    ap.add_argument("--check", action="store_true", help="only say whether this machine can build")
    ap.add_argument("--target", action="append", choices=sorted(tags()), help="only these (repeatable)")
    a = ap.parse_args(argv)
    missing = missing_tools()
    if missing:
        print(f"missing: {' '.join(missing)} (Debian: {APT})", file=sys.stderr)
        return 1
    if a.check:
        print("podman, runc, netavark, aardvark-dns, iptables and mmdebstrap found")
        return 0
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.monotonic()
    try:
        base = base_image(log)
        built = [build(t, base, log) for t in (a.target or ["proxy", "replica-cpu"])]
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(e, file=sys.stderr)
        return 1
    print(f"base {base}")
    for b in built:
        torch = "with torch" if has_torch(b.tag) else "no torch"
        print(f"{b.tag:<40} {b.size_mb:7.0f} MB  built in {b.seconds:5.0f} s  ({torch})")
    replica = next((b for b in built if b.target == "replica-cpu"), None)
    if replica and not a.no_start:
        try:
            s = time_replica_start(replica.tag)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        ended = "; ".join(x.removeprefix("stage: ") for x in s.stages if x.endswith(" s"))  # not the "..." ones
        print(f"{replica.tag}: container start to ready {s.seconds:.1f} s ({ended})")
        if "did not build" in s.log:  # kernels.cpu_build.builds: a kernel compiled (and failed) at start
            log(f"a C++ kernel did not load from the image; the replica's log:\n{s.log}")
            return 1
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
