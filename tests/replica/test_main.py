"""`python -m replica`'s flags as the engine gets them."""

import dataclasses

import pytest

from replica.__main__ import engine_config, parse_args


def test_activation_flags_reach_the_engine_config():
    cfg = engine_config(parse_args(["--decode-activations", "int8", "--prefill-activations", "int16"]))
    assert (cfg.decode_activations, cfg.prefill_activations) == ("int8", "int16")
    default = engine_config(parse_args([]))
    assert (default.decode_activations, default.prefill_activations) == ("int16", "auto")
    with pytest.raises(SystemExit):
        parse_args(["--decode-activations", "auto"])


def test_gpus_handed_over_by_the_environment_are_seen():
    from replica.__main__ import gpus_given

    assert gpus_given({}) == "" and gpus_given({"CUDA_VISIBLE_DEVICES": ""}) == ""
    assert gpus_given({"CUDA_VISIBLE_DEVICES": "-1", "NVIDIA_VISIBLE_DEVICES": "void"}) == ""
    assert gpus_given({"CUDA_VISIBLE_DEVICES": "0,1"}) == "CUDA_VISIBLE_DEVICES=0,1"
    assert gpus_given({"NVIDIA_VISIBLE_DEVICES": "GPU-5f3c"}) == "NVIDIA_VISIBLE_DEVICES=GPU-5f3c"


@pytest.mark.parametrize("flags, env", [(["--device", "cuda"], {}), (["--device", "cuda:1"], {}),
                                        ([], {"CUDA_VISIBLE_DEVICES": "0,1"}),
                                        ([], {"NVIDIA_VISIBLE_DEVICES": "all"})])
def test_a_replica_asked_for_cuda_without_one_refuses_at_once_naming_the_fix(flags, env):
    """This machine's torch is the CPU build: a replica given GPUs or --device cuda exits
    before loading anything (no silent CPU replica with int4 weights), and says what to do.
    The CPU time it takes is the bound (the wall clock of a busy machine is not)."""
    import os
    import resource
    import subprocess
    import sys
    from importlib import metadata

    from tests.replica.server import free_port

    if not metadata.version("torch").endswith("+cpu"):
        pytest.skip("needs a CPU-only torch (this one is a CUDA build)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**{k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")},
           **env}
    r = subprocess.run([sys.executable, "-m", "replica", "--port", str(free_port()), *flags], env=env,
                       capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert r.returncode != 0 and "stage:" not in r.stderr, r.stderr  # no stage ended: nothing loaded
    assert "asked for CUDA" in r.stderr and "CPU-only build" in r.stderr, r.stderr
    assert "TORCH=torch==2.13.0" in r.stderr and "--device cpu" in r.stderr, r.stderr
    assert cpu_s < 2.0, cpu_s


def test_cpu_stays_cpu_and_is_chosen_without_gpus():
    from importlib import metadata

    from replica.__main__ import check_device, default_device

    if not metadata.version("torch").endswith("+cpu"):
        pytest.skip("needs a CPU-only torch (this one is a CUDA build)")
    assert default_device({}) == "cpu" and default_device({"CUDA_VISIBLE_DEVICES": "0"}) == "cuda"
    check_device("cpu", "cpu", {"CUDA_VISIBLE_DEVICES": "0"})  # asked for the CPU: served there
    with pytest.raises(ValueError, match=r"asked for CUDA \(CUDA_VISIBLE_DEVICES=0\)"):
        check_device("cuda", None, {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match=r"asked for CUDA \(--device cuda:1\)"):
        check_device("cuda:1", "cuda:1", {})


def test_the_start_line_says_what_auto_speculation_does_on_this_device_type(tmp_path):
    """A head with a CPU policy that pays: on for a CPU replica, off for a cuda one, saying why."""
    from replica.__main__ import speculation_said
    from speculative.policy import SpecPolicy
    from speculative.tree_spec import TreeSpec

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_text("")
    SpecPolicy(((1, TreeSpec.chain(3)), (4, None)), device="cpu", measured_on="AMD EPYC").save(tmp_path)
    cpu = engine_config(parse_args(["--device", "cpu", "--spec-head", str(tmp_path)]))
    assert speculation_said(cpu, "default").startswith("speculative decoding on: EAGLE-3 head in")
    cuda = dataclasses.replace(cpu, device="cuda", quantization="none", dtype="bfloat16")
    said = speculation_said(cuda, "default")
    assert said.startswith("speculative decoding off:") and "measured on AMD EPYC, not on cuda" in said, said
    assert speculation_said(dataclasses.replace(cpu, speculative="off"), "default") == "speculative decoding off"


def test_fused_decode_is_opt_in_and_reaches_the_kernel_set():
    from replica.model.runner import kernel_set

    assert engine_config(parse_args([])).fused_decode is False
    cfg = engine_config(parse_args(["--device", "cpu", "--fused-decode"]))
    assert cfg.fused_decode is True and kernel_set(cfg).fused_decode is True
    assert kernel_set(dataclasses.replace(cfg, fused_decode=False)).fused_decode is False
