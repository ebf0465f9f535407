import time

import pytest

from torchkiln import hardware
from torchkiln.doctor import diagnose
from torchkiln.hardware import probe


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    probe.clear_cache()
    hardware.detect.cache_clear()
    yield
    probe.clear_cache()
    hardware.detect.cache_clear()


def test_healthy_device_is_usable():
    # The CPU stands in for an accelerator: same child, same first touch.
    r = probe.probe("cpu", [0], timeout=60)["cpu:0"]
    assert r["usable"] is True and r["problem"] is None


def test_hanging_device_times_out_and_caller_returns(monkeypatch):
    monkeypatch.setenv(probe.FAULT_ENV, "cpu:0=hang")
    t = time.monotonic()
    r = probe.probe("cpu", [0], timeout=2)["cpu:0"]
    assert time.monotonic() - t < 10
    assert r["usable"] is False and "timed out after 2 s" in r["problem"]


@pytest.mark.parametrize("fault,text", [("fail", "simulated failure"), ("crash", "exit code")])
def test_failing_device_reports_reason(monkeypatch, fault, text):
    monkeypatch.setenv(probe.FAULT_ENV, f"cpu:0={fault}")
    r = probe.probe("cpu", [0], timeout=60)["cpu:0"]
    assert r["usable"] is False and text in r["problem"]


def test_results_are_cached_per_process(monkeypatch):
    monkeypatch.setenv(probe.FAULT_ENV, "cpu:0=fail")
    first = probe.probe("cpu", [0], timeout=60)["cpu:0"]
    monkeypatch.delenv(probe.FAULT_ENV)
    assert probe.probe("cpu", [0], timeout=60)["cpu:0"] is first


def test_detect_skips_bad_devices_and_doctor_explains(monkeypatch):
    # Two fake CUDA devices: one hangs at first touch, one fails. Neither may be chosen.
    monkeypatch.setattr(hardware, "_device_counts", lambda: {"cuda": 2})
    monkeypatch.setenv(probe.FAULT_ENV, "cuda:0=hang,cuda:1=fail")
    t = time.monotonic()
    hw = hardware.detect(probe=True, timeout=2)
    assert time.monotonic() - t < 15
    assert [a.usable for a in hw.accelerators] == [False, False]
    assert hardware.devices(hw) == ["cpu"] and hardware.default_device(hw) == "cpu"
    causes = {p.device: p.cause for p in diagnose(hw, env={})}
    assert causes == {"cuda:0": "probe_timeout", "cuda:1": "probe_failed"}
