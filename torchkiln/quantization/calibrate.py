"""Calibration: run any iterable of inputs through an observed model, with a progress bar.

A batch is a tensor, a tuple/list of positional arguments, or a dict of keyword arguments
(the convention of ``sample_input`` everywhere in torchkiln).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .. import inputs
from ..modelutil import first_line, model_device
from ..pristine import Pristine
from ..progress import progress


def batches(data, name: str = "calib_data", limit: int | None = None) -> list[inputs.Args]:
    """The batches of ``data`` as (args, kwargs), at most ``limit`` of them."""
    if data is None:
        return []
    if isinstance(data, (torch.Tensor, dict)):
        raise TypeError(f"{name} must be an iterable of batches (a list of tensors, tuples or dicts); got one "
                        f"{type(data).__name__}: wrap it in a list, e.g. {name}=[x]")
    try:
        it = iter(data)
    except TypeError:
        raise TypeError(f"{name} must be an iterable of batches, got {type(data).__name__}") from None
    out = []
    for i, b in enumerate(it):
        if limit is not None and i >= limit:
            break
        try:
            out.append(inputs.normalize(b))
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name}[{i}]: {e}") from None
    return out


def check_fits(model: nn.Module, data: list[inputs.Args], name: str = "calib_data") -> None:
    """Each batch binds to ``model.forward``'s parameters, else a TypeError naming the batch. Checked
    before export: torch.export raised a bare "too many positional arguments" for a DataLoader's
    (inputs, labels) pairs, naming neither the batch nor the argument (the thirtieth session's probes)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # nothing to check against
        return
    for i, (a, k) in enumerate(data):
        try:
            sig.bind(*a, **k)
        except TypeError as e:
            hint = ""
            if len(a) == 2 and not k and all(isinstance(t, torch.Tensor) for t in a) and not a[1].is_floating_point():
                hint = (f"; a DataLoader over (inputs, labels) yields pairs, which count as two positional "
                        f"arguments: pass {name}=(x for x, _ in loader)")
            raise TypeError(f"{name} batch {i} does not fit {type(model).__name__}.forward{sig}: {e} "
                            f"({len(a)} positional, keywords {sorted(k)}){hint}") from None


def check_runs(model: nn.Module, batch: inputs.Args, name: str, index: int = 0) -> None:
    """One eager call of the float model on ``batch`` (its state put back after), before torch.export
    traces it: a batch the model rejects (a wrong feature size) raised from inside export's fake
    tensors, "a and b must have same reduction dim, but got [s31, s81] X [64, 128]", after a page of
    logged traceback (the thirty-third session's probes)."""
    a, k = inputs.to(batch, model_device(model))
    snap = Pristine(model, a, k)
    try:
        with torch.no_grad():
            model(*a, **k)
    except Exception as e:
        raise ValueError(f"{name} batch {index} was rejected by the model itself ({type(e).__name__}: "
                         f"{first_line(e)}); pass batches its forward() takes") from e
    finally:
        snap.restore()


def run(model: nn.Module, data: list[inputs.Args], device, what: str = "calibrating",
        show: bool = True) -> list:
    """Call ``model`` on every batch (moved to ``device``) and return the outputs; a batch the
    model rejects raises an error that names its index."""
    outs = []
    with progress(show and len(data) > 1) as prog, torch.no_grad():
        task = prog.add_task(what, total=len(data)) if prog is not None else None
        for i, (a, k) in enumerate(data):
            a, k = inputs.to((a, k), device)
            try:
                outs.append(model(*a, **k))
            except Exception as e:
                raise rejected(e, f"{what}: batch {i} was rejected by the model") from e
            if prog is not None:
                prog.advance(task)
    return outs


def layer_inputs(model: nn.Module, names: list[str], data: list[inputs.Args], device, on_input) -> None:
    """Run ``data`` through ``model``, calling ``on_input(name, x)`` with the first input of each
    named submodule at every call (forward pre-hooks, removed afterwards)."""
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_pre_hook(lambda _m, args, n=n: on_input(n, args[0].detach()))
             for n in names]
    try:
        with torch.no_grad():
            for a, k in data:
                a, k = inputs.to((a, k), device)
                model(*a, **k)
    finally:
        for h in hooks:
            h.remove()


def rejected(e: Exception, where: str) -> Exception:
    """``e`` re-made with ``where`` in front (same type where its constructor takes a message)."""
    msg = f"{where}: {type(e).__name__}: {e}"
    try:
        return type(e)(msg)
    except Exception:
        return RuntimeError(msg)
