"""Saving and loading quantized models, without pickle and without re-calibrating.

One file, written with ``torch.save`` and read with ``torch.load(weights_only=True)``:

    {"format": "torchkiln.quantized/1",
     "manifest": "<JSON: config, backend, accuracy report, model fingerprint, calibration, smoothing>",
     "tensors": {name: tensor}}

- torchao schemes (fp8, int8-dynamic on CUDA, int8 weight-only on float32 CPU models) and the
  kernels backend (weight-only on CUDA, int4 on the CPU, int8 on bf16/fp16 CPU models: int8 weights,
  scales, biases and packed int4 as plain tensors, GPTQ's codes included): ``tensors`` is the
  quantized model's state_dict. torchao's tensor subclasses are on torch's weights_only allow-list
  (torchao registers them), so no arbitrary object is unpickled.
- pt2e schemes (CPU int8-static/-smoothquant/-dynamic): ``tensors`` holds the float weights
  and the export example; the observers' state is JSON in the manifest. Loading re-exports the
  model and converts it with that state: no calibration data is needed.

``load(model, path)`` takes the float model's architecture (weights may be random), checks the
fingerprint (every state_dict name and shape), and builds the quantized model on a copy: a file
from another model, or a corrupted one, raises ValueError and loads nothing.
"""

from __future__ import annotations

import copy
import json
import os

import torch
from torch import nn

from . import pt2e_flow, smoothquant
from .accuracy import AccuracyReport, OutputAccuracy
from .api import Prepared, QuantInfo, QuantizedGraph, _observed, apply_layers, info
from .config import QuantConfig

FORMAT = "torchkiln.quantized/1"


def _fingerprint(model: nn.Module) -> dict:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def save(model: nn.Module, path, float_model: nn.Module | None = None, overwrite: bool = False) -> None:
    """Write a model returned by tk.quantize. pt2e schemes also need ``float_model`` (the
    model that was quantized): their file carries its float weights."""
    qi = info(model)
    if qi is None:
        raise TypeError("save() expects a model returned by tk.quantize() (it has .kiln_quant); got "
                        f"{type(model).__name__}")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    if qi.backend == "pt2e":
        if float_model is None:
            raise ValueError(f"{qi.config.scheme} via pt2e: pass float_model= (the model you quantized); the file "
                             "stores its float weights and the calibration, and load() converts them again")
        tensors = {f"model.{k}": v.detach().cpu() for k, v in float_model.state_dict().items()}
        args, kwargs = qi.sample
        tensors.update({f"sample.args.{i}": a.cpu() for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
        tensors.update({f"sample.kwargs.{k}": v.cpu() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        if _fingerprint(float_model) != qi.fingerprint:
            raise ValueError("float_model is not the model that was quantized (its state_dict names or shapes differ)")
    else:
        tensors = {f"model.{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    # int4 in tinygemm's layout is packed per device type (CUDA and CPU differ): the file says which
    packed = next((b.device.type for n, b in model.named_buffers() if n.endswith("scale_zero")), None)
    manifest = {"config": qi.config.to_dict(), "backend": qi.backend, "report": qi.report.to_dict(),
                "packed_for": packed,
                "fingerprint": qi.fingerprint, "calibration": qi.calibration, "smoothing": qi.smoothing,
                "alphas": qi.alphas,
                # the calibration's observers are those of a graph with sibling linears merged
                # (concat_linear_fx.py); files without the key predate the merge
                "merged_linears": qi.backend == "pt2e",
                "torch": torch.__version__}
    torch.save({"format": FORMAT, "manifest": json.dumps(manifest), "tensors": tensors}, path)


def load(model: nn.Module, path, device=None) -> nn.Module:
    """The quantized model saved at ``path``, built on a copy of ``model`` (its architecture)."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ValueError(f"no {FORMAT!r} marker")
        manifest = json.loads(blob["manifest"])
        tensors = blob["tensors"]
        config = QuantConfig.from_dict(manifest["config"])
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ValueError(f"{path} is not a torchkiln quantized model file, or it is corrupted "
                         f"({type(e).__name__}: {e})") from None
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    saved = manifest.get("fingerprint")
    if saved is not None:
        _same_model(expected, saved, path)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    q = copy.deepcopy(model).eval()
    report = _report(manifest["report"])
    qi = QuantInfo(config, manifest["backend"], report, calibration=manifest.get("calibration") or {},
                   smoothing=manifest.get("smoothing") or {}, alphas=manifest.get("alphas") or {},
                   fingerprint=expected)
    if qi.backend == "pt2e":
        q.load_state_dict(weights, strict=True)
        args = tuple(v for k, v in sorted(tensors.items()) if k.startswith("sample.args."))
        kwargs = {k.removeprefix("sample.kwargs."): v for k, v in tensors.items() if k.startswith("sample.kwargs.")}
        qi.sample = (args, kwargs)
        amax = {n: torch.tensor(v) for n, v in qi.smoothing.items()}

        def smooth(m):
            if config.scheme == "int8-smoothquant":
                smoothquant.smooth(m, amax, qi.alphas if config.alpha == "auto" else config.alpha)

        observed = _observed(q, config, qi.sample, dev, smooth, manifest.get("merged_linears", False))
        pt2e_flow.load_observer_state(observed, qi.calibration)
        return QuantizedGraph(pt2e_flow.convert(observed), qi)
    if qi.backend == "kernels":
        packed = manifest.get("packed_for")
        if packed is not None and packed != dev.type:
            raise ValueError(f"{path} holds int4 weights packed for {packed} (tinygemm's layout differs per device "
                             f"type); load it with device={packed!r}, or quantize again for {dev.type}")
        q = q.to(dev)
    apply_layers(q, config, dev, qi.backend)
    try:
        q.load_state_dict(weights, strict=True, assign=True)
    except Exception as e:
        raise ValueError(f"{path} does not match this model: {type(e).__name__}: {e}") from None
    q.kiln_quant = qi
    return q


def _same_model(expected: dict, saved: dict, path) -> None:
    missing = [k for k in saved if k not in expected]
    extra = [k for k in expected if k not in saved]
    shapes = [k for k in saved if k in expected and expected[k] != saved[k]]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) this model lacks, e.g. {missing[0]!r}")
        if extra:
            parts.append(f"{len(extra)} tensor(s) the file lacks, e.g. {extra[0]!r}")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es), e.g. {shapes[0]!r} {saved[shapes[0]]} vs "
                         f"{expected[shapes[0]]}")
        raise ValueError(f"{path} was saved from a different model: " + "; ".join(parts))


def _report(d: dict) -> AccuracyReport:
    d = dict(d)
    d.pop("min_sqnr_db", None)
    d.pop("passed", None)
    outs = [OutputAccuracy(**o) for o in d.pop("outputs", [])]
    return AccuracyReport(**d, outputs=outs)


def save_calibration(prepared: Prepared, path, overwrite: bool = False) -> None:
    """The calibration (observer ranges and histograms, SmoothQuant maxima) as JSON."""
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    with open(path, "w") as f:
        json.dump({"format": "torchkiln.calibration/1", "scheme": prepared.config.scheme,
                   "observers": prepared.calibration(), "smoothing": prepared.smoothing}, f)


def load_calibration(prepared: Prepared, path) -> None:
    """Restore a calibration saved by save_calibration: convert() then needs no calibration data."""
    with open(path) as f:
        d = json.load(f)
    if d.get("format") != "torchkiln.calibration/1":
        raise ValueError(f"{path} is not a torchkiln calibration file")
    if d["scheme"] != prepared.config.scheme:
        raise ValueError(f"{path} calibrates {d['scheme']!r}, the prepared model is {prepared.config.scheme!r}")
    prepared.load_calibration(d["observers"])
    object.__setattr__(prepared, "calibrated_from_file", True)
