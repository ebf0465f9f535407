"""Importing torchkiln must change nothing global. Checked in a fresh interpreter."""

import json
import os
import subprocess
import sys

import pytest

SNAPSHOT = r"""
import json, logging, os, warnings, torch
def snap():
    lg = logging.getLogger("torchkiln")
    return {
        "root_handlers": len(logging.root.handlers), "root_level": logging.root.level,
        "tk_handlers": len(lg.handlers), "tk_level": lg.level,
        "loggers": sorted(k for k, v in logging.Logger.manager.loggerDict.items()
                          if isinstance(v, logging.Logger) and (v.handlers or v.level)),
        "env": dict(os.environ), "threads": torch.get_num_threads(),
        "dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
        "matmul": torch.get_float32_matmul_precision(), "warnings": len(warnings.filters),
        "cudnn_bench": torch.backends.cudnn.benchmark, "mkldnn": torch.backends.mkldnn.enabled,
        "flush_denormal": torch.set_flush_denormal(False),
    }
before = snap()
import torchkiln, torchkiln.cli, torchkiln.doctor  # noqa
after = snap()
print(json.dumps({"before": before, "after": after}))
"""


def test_import_has_no_side_effects():
    env = {**os.environ, "TORCHKILN_LOG": "debug"}
    out = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, env=env, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["before"] == res["after"]


def test_log_env_applies_on_first_public_call(monkeypatch):
    import logging

    from torchkiln import _log

    logger = logging.getLogger("torchkiln")
    old = (logger.level, list(logger.handlers), _log._handler)
    try:
        monkeypatch.setenv("TORCHKILN_LOG", "info")
        _log.configure()
        assert logger.level == logging.INFO and _log._handler in logger.handlers
        assert _log._handler not in logging.root.handlers
        monkeypatch.setenv("TORCHKILN_LOG", "loud")  # a typo in the environment: said and ignored, as it
        with pytest.warns(UserWarning, match="TORCHKILN_LOG='loud' is not one of debug"):  # stopped every command
            _log.configure()
        assert logger.level == logging.INFO  # left as it was
        with pytest.raises(ValueError, match="'loud' is not one of debug"):  # asked for by name: an error
            _log.configure("loud")
    finally:
        logger.setLevel(old[0])
        logger.handlers[:] = old[1]
        _log._handler = old[2]
