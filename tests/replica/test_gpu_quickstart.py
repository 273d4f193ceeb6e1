"""README.md's "On GPUs" commands, run here as far as a CPU allows: `make install` installs
the CUDA torch it names and the lock; the secret line makes a secret; the replica command
as written refuses at once on this CPU-only torch (no silent CPU replica), and the same
command on the CPU (`--device cpu`, a Llama-shaped folder the test writes) serves at
`--tp 2` behind the README's proxy command, which the official openai SDK talks to."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.replica.model.llama_folder import write_llama_folder
from tests.replica.server import SECRET, free_port, replica_server, stop_group, wait_healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
         "tie_word_embeddings": False, "eos_token_id": 0, "bos_token_id": 1}


def quickstart() -> list[str]:
    """The command lines of the README's "On GPUs" section (its first fenced block)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## On GPUs"):]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def command(prefix: str) -> list[str]:
    (line,) = [c for c in quickstart() if c.startswith(prefix)]
    return shlex.split(line)


def flag(argv: list[str], name: str, value: str) -> list[str]:
    """argv with `name`'s value replaced."""
    i = argv.index(name)
    return argv[:i + 1] + [value] + argv[i + 2:]


def test_the_quickstart_is_four_commands():
    assert [c.split()[0] for c in quickstart()] == ["make", "export", ".venv/bin/python", ".venv/bin/python"]


def test_make_install_installs_the_cuda_torch_it_names_and_the_lock():
    (make,) = [shlex.split(c) for c in quickstart() if c.startswith("make ")]
    assert make == ["make", "install"]
    dry = subprocess.run(["make", "-n", "-B", *make[1:]], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert 'pip install -q "torch==2.13.0"' in dry  # PyPI's Linux wheel of 2.13.0: the CUDA 13 build
    assert "--require-hashes --no-deps -r lock/base.txt -r lock/replica.txt" in dry


def test_the_secret_line_makes_a_secret():
    (line,) = [c for c in quickstart() if c.startswith("export ")]
    inner = re.fullmatch(r"export EDGECHAT_REPLICA_SECRET=\$\((.*)\)", line).group(1)
    out = subprocess.run(shlex.split(inner), capture_output=True, text=True, check=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", out)


def test_the_replica_command_refuses_on_a_cpu_only_torch():
    if not metadata.version("torch").endswith("+cpu"):
        pytest.skip("this torch is a CUDA build: the command would serve")
    argv = flag(command(".venv/bin/python -m replica"), "--port", str(free_port()))
    r = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET})
    assert r.returncode != 0 and "asked for CUDA (--device cuda)" in r.stderr and "CPU-only build" in r.stderr, \
        r.stderr


def test_the_commands_serve_at_tp_2_on_the_cpu(tmp_path):
    """The replica and proxy commands as written but for the device, model path and ports."""
    from openai import OpenAI

    folder = tmp_path / "Llama-shaped"
    write_llama_folder(folder, SMALL)
    replica = flag(flag(command(".venv/bin/python -m replica"), "--device", "cpu"), "--model", str(folder))
    assert replica[replica.index("--tp") + 1] == "2"
    replica = flag(replica, "--port", "{port}") + ["--kv-memory-gb", "0.05"]
    with replica_server(cmd=[sys.executable, *replica[1:]], cwd=str(ROOT)) as (url, _):
        port = free_port()
        proxy = command(".venv/bin/python -m edge_proxy")
        proxy = flag(flag(proxy, "--replica", url.replace("http", "ws") + "/v1/replica"), "--tokenizer",
                     str(folder))
        proxy = flag(proxy, "--port", str(port))
        proc = subprocess.Popen([sys.executable, *proxy[1:]], cwd=ROOT, start_new_session=True,
                                env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET})
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, proc, timeout=120)  # 200 once its replica is ready
            client = OpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0)
            model = client.models.list().data[0].id
            out = client.completions.create(model=model, prompt="hello world", max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
        finally:
            stop_group(proc)
