import json
from dataclasses import replace

from torchkiln import cli
from torchkiln.doctor import diagnose
from torchkiln.hardware import GPUPresence, detect


def run_json(capsys, *argv):
    assert cli.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_json_shape(capsys):
    out = run_json(capsys, "doctor", "--json")
    assert set(out) == {"torchkiln", "hardware", "devices", "default_device", "problems", "quantization", "onednn_net"}
    assert set(out["quantization"]) == set(out["devices"])
    assert out["quantization"]["cpu"]["fp8"][0] is False  # fp8 needs a GPU
    hw = out["hardware"]
    assert set(hw) == {"platform", "cpu", "accelerators", "software", "gpus_present"}
    assert {"vendor", "model", "physical_cores", "sockets", "numa_nodes", "memory_bytes", "features",
            "unknown"} <= set(hw["cpu"])
    assert isinstance(hw["cpu"]["features"], list)
    assert {"torch", "torchao", "transformers", "backends"} <= set(hw["software"])
    assert out["devices"][-1] == "cpu" and out["default_device"] == out["devices"][0]
    for acc in hw["accelerators"]:
        assert {"type", "index", "name", "memory_bytes", "capability", "bf16", "fp16", "fp8", "usable"} <= set(acc)


def test_doctor_text_mentions_isa(capsys):
    assert cli.main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "ISA:" in text and "Devices" in text


def test_version(capsys):
    import torchkiln

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"torchkiln {torchkiln.__version__}"
    for argv in (["--json", "--version"], ["--version", "--json"]):
        assert cli.main(argv) == 0
        assert json.loads(capsys.readouterr().out) == {"torchkiln": torchkiln.__version__}


def _with(gpu, torch_cuda=None, cuda_backend=False):
    hw = detect(probe=False)
    sw = replace(hw.software, torch_cuda=torch_cuda, backends={**hw.software.backends, "cuda": cuda_backend})
    return replace(hw, accelerators=(), gpus_present=(gpu,), software=sw)


def test_cpu_torch_on_nvidia_machine_gets_install_hint():
    hw = _with(GPUPresence("nvidia", "0000:01:00.0", True, "580.159.03"))
    (p,) = diagnose(hw, env={})
    assert p.cause == "torch_without_backend"
    assert "pip install" in p.fix and "cu130" in p.fix


def test_nvidia_without_driver():
    (p,) = diagnose(_with(GPUPresence("nvidia", "0000:01:00.0", False, None)), env={})
    assert p.cause == "no_driver" and "driver" in p.fix


def test_driver_too_old_for_torch_cuda():
    hw = _with(GPUPresence("nvidia", "x", True, "470.82.01"), torch_cuda="12.4", cuda_backend=True)
    (p,) = diagnose(hw, env={})
    assert p.cause == "version_mismatch" and "525" in p.detail and "cu118" in p.fix


def test_gpus_hidden_by_env():
    hw = _with(GPUPresence("nvidia", "x", True, "580.1"), torch_cuda="13.0", cuda_backend=True)
    (p,) = diagnose(hw, env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.cause == "hidden_by_env"


def test_bad_timeout_env_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("TORCHKILN_PROBE_TIMEOUT", "soon")
    assert cli.main(["doctor", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert "TORCHKILN_PROBE_TIMEOUT" in out["message"] and "soon" in out["message"]


def test_doctor_says_whether_the_int8_net_can_be_built(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHKILN_ONEDNN_ROOT", str(tmp_path))  # an empty prefix: no oneDNN there
    out = run_json(capsys, "doctor", "--json")
    assert out["onednn_net"]["available"] is False
    assert str(tmp_path) in out["onednn_net"]["detail"] and "torchkiln[onednn]" in out["onednn_net"]["detail"]
    assert cli.main(["doctor"]) == 0
    assert "CNN net  not available" in capsys.readouterr().out
