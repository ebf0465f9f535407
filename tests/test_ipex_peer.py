"""The IPEX peer's driver and worker (torchkiln/ipex_peer.py), without IPEX: CI has no IPEX venv,
so the IPEX side is exercised by its failure path (a python without intel_extension_for_pytorch),
and the interleaved timing by the peers that run here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torchkiln import cli, ipex_peer


def test_compare_times_peers_interleaved_and_reports_a_missing_ipex():
    # this python has no IPEX: that peer must fail with its import error, the others still run
    cell = ipex_peer.compare("mlp", "float32", 2, peers=("ipex", "torchkiln"), rounds=2, iters=2,
                             ipex_python=sys.executable)
    assert "intel_extension_for_pytorch" in cell.errors["ipex"]
    assert cell.median_ms["ipex"] is None and cell.ratio is None
    assert cell.median_ms["torchkiln"] > 0 and cell.served  # timed, and says what it served
    row = cell.row()
    assert row.startswith("| mlp | 2 | float32 |") and "failed (" in row and "not run" in row  # compile not asked
    assert json.loads(json.dumps(cell.to_dict()))["errors"] == cell.errors


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="unknown peer"):
        ipex_peer.compare("mlp", peers=("ipex", "onnx"))
    with pytest.raises(ValueError, match="float16"):
        ipex_peer.compare("mlp", "float16", peers=("torchkiln",))
    with pytest.raises(FileNotFoundError, match="ipex_env.sh"):
        ipex_peer.compare("mlp", peers=("ipex",), ipex_python="/nonexistent/python")


def test_cli_peer_ipex_errors_are_one_line(capsys):
    rc = cli.main(["bench", "resnet50", "--peer", "ipex", "--ipex-python", "/nonexistent/python", "--json"])
    assert rc == 2 and "ipex_env.sh" in json.loads(capsys.readouterr().out)["message"]
    rc = cli.main(["bench", "pkg.mod:fn", "--peer", "ipex"])
    assert rc == 2 and "zoo models" in capsys.readouterr().err


def test_worker_loads_the_zoo_without_torchkiln_importable():
    """In the IPEX venv torchkiln is not installed: the worker loads zoo.py by path."""
    code = ("import sys, importlib.util; sys.modules['torchkiln'] = None\n"
            f"spec = importlib.util.spec_from_file_location('w', {ipex_peer.__file__!r})\n"
            "w = sys.modules['w'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)\n"
            "zoo = w._zoo(); m, x = zoo.load('mlp', batch=3); print(zoo.__name__, tuple(m(x).shape))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.split()[0] == "_torchkiln_zoo" and "(3," in out.stdout
