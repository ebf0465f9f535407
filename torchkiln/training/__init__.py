"""Training: ``model, optimizer = tk.optimize(model, optimizer=opt, dtype=...)``.

Plan (recipe.py: precision per device), optimizer (fuse.py: torch's fused step,
same object; split.py: bf16 weights with exact fp32 masters, on request),
candidates (module.py: eager vs compiled forward+backward, verified on one
step's outputs and gradients, timed, the faster served). The returned model's
parameters and state_dict are the original's, so checkpoints load both ways and
the optimizer needs no change.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import torch
from torch import nn

from .. import inputs
from .._log import warn_once
from ..hardware import detect
from ..modelutil import first_line, is_oom, model_device, model_dtype, parse_dtype
from ..report import Report
from ..runtime import allocator as _allocator
from . import fuse as _fuse
from . import split as _split
from .module import _LABELS, AutocastStep, TrainModule, _world
from .recipe import TrainRecipe, plan_training

__all__ = ["optimize_training", "TrainModule", "TrainRecipe", "AutocastStep"]

_DONE: weakref.WeakSet = weakref.WeakSet()  # optimizers already handed to optimize_training


def optimize_training(model: nn.Module, optimizer: torch.optim.Optimizer, dtype=None, level: str = "O1",
                      sample_input=None, device=None, verify: str = "shapes", time_budget: float = 2.0,
                      knobs: dict | None = None) -> tuple[TrainModule, torch.optim.Optimizer]:
    knobs = knobs or {}
    t0 = time.perf_counter()
    _validate(model, optimizer)
    here = model_device(model)
    if device is not None and torch.device(device).type != here.type:
        raise ValueError(f"device={str(device)!r}, but the model's parameters are on {here}; for training, move "
                         f"the model (and build the optimizer after) first: model.to({str(device)!r})")
    compute = parse_dtype(dtype)
    hw = detect()
    dev = str(here) if here.type == "cpu" or here.index is not None else f"{here.type}:0"
    kind, why = _fuse.choose(optimizer, level)
    recipe = plan_training(hw, dev, compute, level, knobs, (kind, why), distributed=_world() > 1,
                           own=model_dtype(model))  # may raise
    split = []
    if recipe.master_weights == "split":
        why_not = _split.why_not(optimizer)
        split = [] if why_not else _split.split_params(model, optimizer)
        if not split:
            why_not = why_not or "no float32 weight (2+ dims) on one device to split"
            recipe = dataclasses.replace(recipe, master_weights="fp32",
                                         notes=(*recipe.notes, f"split_master_weight_for_bf16: not used: {why_not}"))
    no_keep = _allocator.why_not() if recipe.allocator == "keep" else None
    if no_keep:
        recipe = dataclasses.replace(recipe, allocator="default", notes=(*recipe.notes, f"allocator: left as it is: {no_keep}"))
    if recipe.precision != "params" and recipe.dtype != str(compute).removeprefix("torch."):
        warn_once(f"train-dtype:{compute}:{dev}", "torchkiln: " + recipe.notes[0])
    if kind == "own step":
        warn_once(f"train-opt:{type(optimizer).__name__}", f"torchkiln: {why}")
    if kind == "fused":
        _fuse.fuse(optimizer)
    _DONE.add(optimizer)
    precision = f"{recipe.dtype} parameters (as given)" if recipe.precision == "params" else \
        f"{recipe.precision} {recipe.dtype}"
    applied = [precision, f"optimizer {recipe.optimizer}"]
    splitter = None
    if split:
        splitter = _split.SplitWeights(split, optimizer)
        applied.append(f"split master weights: {len(split)} weights, "
                       f"{sum(p.numel() for p in split) * 2 / 2**20:.1f} MiB of bf16 + the same of trails")
    report = Report(recipe=recipe.to_dict(), applied=applied)
    tm = TrainModule(model, recipe, report, verify, float(time_budget), splitter)
    if sample_input is not None and recipe.compile:
        args, kwargs = inputs.to(inputs.normalize(sample_input), here)
        try:
            tm._setup(args, kwargs)
        except Exception as e:
            if is_oom(e):
                raise
            raise ValueError(f"sample_input does not run through the model: {type(e).__name__}: {first_line(e)}. "
                             "Pass a batch the model accepts (as a tensor, a tuple of arguments or a dict of "
                             "keyword arguments)") from e
    elif not recipe.compile:
        tm._keep_memory()  # no candidates to build: the step's memory settings now
        # nothing left to choose: the report said "pending first call" for good (a new-user probe)
        report.active = f"{_LABELS['eager']} ({recipe.dtype})"
    report.optimize_seconds = round(time.perf_counter() - t0, 3)
    return tm, optimizer


def _validate(model: nn.Module, optimizer) -> None:
    if isinstance(model, TrainModule) or optimizer in _DONE:
        raise ValueError("this model/optimizer pair was already optimized by torchkiln; use the pair "
                         "tk.optimize returned the first time (optimizing twice would wrap it twice)")
    from ..optimize import KilnModule

    if isinstance(model, KilnModule):
        raise ValueError("this model was optimized for inference; for training pass the original: "
                         "tk.optimize(model.kiln_original.train(), optimizer=opt, ...)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= expects a torch.optim.Optimizer (or tk.optim.Lamb/Lars), got "
                        f"{type(optimizer).__name__}")
    if not model.training:
        raise ValueError("the model is in eval mode but an optimizer was given. For training call model.train() "
                         "before tk.optimize(model, optimizer=opt, ...); for inference leave out optimizer=")
    mine = {id(p) for p in model.parameters()}
    theirs = [p for g in optimizer.param_groups for p in g["params"]]
    if not theirs:
        raise ValueError("optimizer= holds no parameters; build it over model.parameters()")
    # Some parameters besides the model's (a learnable loss temperature) are the user's business: eager
    # trains them, and so does this optimizer (refusing them, a new-user probe found, fifty-first session,
    # while add_param_group after the call took them). None of the model's is a mistake.
    foreign = sum(id(p) not in mine for p in theirs)
    if foreign == len(theirs):
        cls = type(optimizer)
        name = f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__qualname__
        raise ValueError(f"optimizer= holds none of the model's parameters ({foreign} others); build "
                         f"it over this model's parameters: {name}(model.parameters(), ...)")
