import json

import pytest
import torch

from torchkiln import cli, zoo
from torchkiln.bench import bench


def test_bench_rows_speedups_and_errors(tmp_path):
    m, x = zoo.load("mlp", batch=4)
    r = bench(m, x, peers=["compile+freezing", "torchkiln"], iters=4, warmup=1, rounds=2, progress=False)
    assert [row.name for row in r.rows] == ["eager", "compile+freezing", "torchkiln"]
    eager = r.rows[0]
    assert eager.speedup == 1.0 and eager.rel_err == 0.0
    for row in r.rows:
        assert row.median_ms > 0 and row.p90_ms >= row.median_ms and row.p99_ms >= row.p90_ms
        assert row.speedup == pytest.approx(eager.median_ms / row.median_ms, rel=1e-2)
        assert row.rel_err < 1e-4
        assert isinstance(row.peak_mem_mb, float)  # CPU: RSS the peer added
    assert r.flops == pytest.approx(2 * 4 * (256 * 1024 + 1024 * 1024 + 1024 * 10), rel=0.01)
    d = r.to_dict()
    assert d["best_peer"] == "compile+freezing" and d["speedup_vs_best_peer"] > 0
    assert "torchkiln vs best peer" in r.table()
    png = tmp_path / "b.png"
    r.plot(str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_unknown_peer_is_a_clear_error():
    m, x = zoo.load("mlp")
    with pytest.raises(ValueError, match="unknown peers.*available"):
        bench(m, x, peers=["tensorrt"], progress=False)


def test_cli_bench_json_and_plot_overwrite_guard(capsys, tmp_path):
    png = tmp_path / "p.png"
    argv = ["bench", "mlp", "--batch", "4", "--iters", "2", "--warmup", "1", "--peers", "torchkiln", "--json",
            "--plot", str(png)]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in out["rows"]] == ["eager", "torchkiln"] and png.exists()
    assert cli.main(argv) == 2  # exists: refuse without --force
    assert "pass --force" in json.loads(capsys.readouterr().out)["message"]


def test_cli_demo_small_model(capsys):
    assert cli.main(["demo", "--model", "mlp", "--iters", "2", "--warmup", "1", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "torchkiln vs best peer" in text and "compile+freezing" in text


def test_cli_bad_dtype_is_one_clear_line(capsys):
    assert cli.main(["bench", "mlp", "--dtype", "int3"]) == 2
    assert "dtype='int3' is not supported" in capsys.readouterr().err


def test_zoo_resnet50_uses_torchvision_names_and_counts():
    m, x = zoo.load("resnet50")
    keys = m.state_dict().keys()
    assert {"conv1.weight", "layer1.0.downsample.0.weight", "layer4.2.bn3.running_var", "fc.bias"} <= set(keys)
    assert sum(p.numel() for p in m.parameters()) == 25_557_032  # torchvision resnet50
    assert tuple(x.shape) == (1, 3, 224, 224)


def test_zoo_callable_and_errors():
    m, x = zoo.load("torchkiln.zoo:mlp")
    assert isinstance(m, torch.nn.Module) and x.shape == (8, 256)
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        zoo.load("nope")
    with pytest.raises(ValueError, match="cannot import"):
        zoo.load("no_such_pkg:fn")
    with pytest.raises(ValueError, match="--shape"):
        zoo.load("torch.nn:Identity")


def test_demo_model_falls_back_without_transformers(monkeypatch):
    import importlib.util

    from torchkiln import commands

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert commands._default_demo_model() == "resnet50"
    monkeypatch.setattr(importlib.util, "find_spec", real)
    expected = "bert-base" if real("transformers") else "resnet50"
    assert commands._default_demo_model() == expected
