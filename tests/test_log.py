"""warn_once: once per key, and per-object keys die with their object; quiet_deprecations."""

import gc
import subprocess
import sys
import warnings

import pytest
from torch import nn

from torchkiln._log import warn_once


def test_a_new_object_at_a_reused_address_still_warns():
    """Keyed by id(), a model created after another was freed could reuse its address and never
    warn (CI saw exactly this between two parametrisations of one test)."""
    seen = []
    for _ in range(3):
        m = nn.Linear(2, 2)
        seen.append(id(m))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            warn_once("k", "first", owner=m)
            warn_once("k", "second", owner=m)
        assert [str(x.message) for x in w] == ["first"]
        del m
        gc.collect()


def test_without_an_owner_a_key_warns_once_per_process():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        warn_once("test-log-process-key", "a")
        warn_once("test-log-process-key", "b")
    assert [str(x.message) for x in w] == ["a"]


def test_an_owner_that_cannot_be_weakly_referenced_falls_back_to_the_process_key():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        warn_once("test-log-int-owner", "a", owner=7)
        warn_once("test-log-int-owner", "b", owner=7)
    assert [str(x.message) for x in w] == ["a"]


def _warn_from(module: str, category) -> None:
    warnings.warn_explicit("notice", category, "f.py", 1, module=module)


def test_quiet_deprecations_drops_torchs_notices_and_keeps_the_callers_filters():
    """Inside: torch's and torchao's deprecation notices are ignored even under "error"; torchkiln's,
    the caller's and torch's other warnings are filtered as the caller set them. Outside: unchanged."""
    from torchkiln._log import quiet_deprecations

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with quiet_deprecations():
            for module in ("torch", "torch.utils.mkldnn", "torchao.quantization"):
                for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
                    _warn_from(module, category)  # would raise under "error"
            for module, category in (("torchkiln.optimize", DeprecationWarning), ("mycode", FutureWarning),
                                     ("torch._inductor", UserWarning)):
                with pytest.raises(category):
                    _warn_from(module, category)
        with pytest.raises(DeprecationWarning):
            _warn_from("torch.utils.mkldnn", DeprecationWarning)


# A fresh process: the notice that failed compiles (torch.utils.mkldnn's, torch >= 2.13) comes from an
# import, once per process, which this test process has long made.
STRICT = """
import warnings, torch, torchkiln as tk
from torch import nn
warnings.simplefilter("error")
warnings.filterwarnings("ignore", message="torchkiln")  # its own notices (eager may win at this size)
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
x = torch.randn(16, 64)
fast = tk.optimize(m, sample_input=x)
bad = [c for c in fast.kiln_report.candidates if c.status == "failed"]
assert not bad, [(c.name, c.reason) for c in bad]
torch.testing.assert_close(fast(x), m(x), rtol=1e-4, atol=1e-5)
t = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).train()
opt = torch.optim.SGD(t.parameters(), lr=0.1)
t, opt = tk.optimize(t, optimizer=opt)
t(torch.randn(4, 8)).sum().backward()
opt.step()
print("ok")
"""


def test_a_suite_that_turns_warnings_into_errors_gets_every_candidate():
    """`filterwarnings = error` (common in test suites): torch 2.13's own deprecation notice inside
    inductor's import failed every compiled candidate, and tk.optimize(optimizer=) raised."""
    out = subprocess.run([sys.executable, "-c", STRICT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
