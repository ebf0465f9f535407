import json

import torch
from torch import nn

import torchkiln as tk
from torchkiln import cli
from torchkiln.check import check


class GradSensitive(nn.Module):
    """Reproduces the IPEX XPU bug class: output changes when grad is disabled."""

    def forward(self, x):
        return x * (1.0 if torch.is_grad_enabled() else 1.5)


def model(bug=False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), GradSensitive() if bug else nn.Identity(),
                         nn.Linear(16, 4)).eval()


def test_consistent_model_passes_all_checks():
    r = tk.check(model(), torch.randn(4, 16), dtype=torch.bfloat16)
    names = [row.name for row in r.rows]
    assert names[:3] == ["grad vs no_grad", "grad vs inference_mode", "fp32 vs bfloat16 (full cast)"]
    assert names[3].startswith("eager vs optimized (") and names[3].endswith(", new input)")
    assert r.ok
    bf16 = r.rows[2].error["rel"]
    assert 1e-5 < bf16 < 5e-2  # a real bf16 error, not a comparison of a run with itself


def test_errors_are_reported_per_output():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.a(x), self.b(x)

    r = check(Two().eval(), torch.randn(4, 8), checks=("dtype",))
    (row,) = r.rows
    assert len(row.per_output) == 2 and all(0 < e < 5e-2 for e in row.per_output)
    assert "per output: [0]" in str(r)


def test_grad_mode_divergence_is_caught_and_located():
    r = check(model(bug=True), torch.randn(4, 16), checks=("no_grad", "inference_mode"))
    assert not r.ok
    for row in r.rows:
        assert not row.ok and row.first_divergence.startswith("2 (GradSensitive)")
    assert "DIVERGES" in str(r) and "first diverging submodule: 2 (GradSensitive)" in str(r)


def test_cli_check_json_and_exit_code(capsys):
    import json

    assert cli.main(["check", "mlp", "--batch", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and len(out["checks"]) == 4


def test_optimized_row_uses_an_input_the_guard_never_saw():
    m, x = model(), torch.randn(4, 16)

    class Memorizer(nn.Module):
        """Right on the sample it was built with, wrong elsewhere: a guard-only check passes it."""

        def forward(self, t):
            return m(t) if torch.equal(t, x) else m(t) * 1.1

    r = check(m, x, dtype=torch.float32, optimized=Memorizer(), checks=("optimized",))
    (row,) = r.rows
    assert not row.ok and row.error["rel"] > 0.05


def test_check_leaves_the_callers_mode_alone():
    m = model().train()
    m[0].eval()
    check(m, torch.randn(4, 16), checks=("no_grad", "dtype"))
    assert m.training and not m[0].training and m[1].training


def test_cli_check_honours_float32_and_rejects_bad_arguments(capsys):
    """--dtype float32 was read as "not given" and checked bfloat16; --batch 0 passed on empty tensors;
    a bad or absent --device gave a traceback (the new-user sweep, 2026-11-23)."""
    assert cli.main(["check", "mlp", "--batch", "4", "--dtype", "float32", "--json"]) == 0
    names = [c["name"] for c in json.loads(capsys.readouterr().out)["checks"]]
    assert any("float32" in n for n in names) and not any("bfloat16" in n for n in names), names
    for argv, said in ((["--batch", "0"], "--batch 0: must be at least 1"),
                       (["--device", "xyz"], "--device 'xyz' is not a device torch knows"),
                       (["--device", "cuda:99"], "--device 'cuda:99' is not usable")):
        assert cli.main(["--json", "check", "mlp", *argv]) == 2  # --json before the subcommand counts too
        assert said in json.loads(capsys.readouterr().out)["message"]
    assert cli.main(["bench", "mlp", "--iters", "0", "--json"]) == 2
    assert "--iters 0" in json.loads(capsys.readouterr().out)["message"]
