"""tk.quantize and the IPEX-style two-step form (prepare -> calibrate -> convert).

    qmodel = tk.quantize(model, "int8-static", calib_data=loader)
    print(qmodel.kiln_quant.report)          # SQNR/cosine/argmax against fp32, layers kept

    prepared = tk.quantization.prepare(model, "int8-static", example_inputs=x)
    for batch in loader:
        prepared(batch)                       # calibration
    qmodel = tk.quantization.convert(prepared)

The caller's model is never changed: torchkiln quantizes a copy.
"""

from __future__ import annotations

import copy
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import inputs
from .._log import quiet_deprecations, warn_once
from ..hardware import resolve_device
from ..modelutil import dtype_name, is_causal_lm, model_device, model_dtype, tensors, training_module
from . import calibrate, fallback, gptq, pt2e_flow, smoothquant, weight_only
from .accuracy import AccuracyReport, measure, padding_mask
from .config import GROUP_SIZES, QuantConfig, make
from .schemes import _quiet_torchao, backend_for, fast_here, torchao, torchao_config

log = logging.getLogger(__name__)
EVAL_BATCHES = 8  # calibration batches reused to measure accuracy when no eval_data is given
RECORDED = 32  # batches a Prepared model keeps for auto_fallback's re-calibration


@dataclass
class QuantInfo:
    """What ``tk.quantize`` did, attached to its result as ``model.kiln_quant``."""

    config: QuantConfig  # with ``keep`` = every module kept in floating point
    backend: str
    report: AccuracyReport
    sample: inputs.Args | None = None  # the export example (pt2e)
    calibration: dict = field(default_factory=dict)  # pt2e observer state, JSON-ready
    smoothing: dict = field(default_factory=dict)  # SmoothQuant: module -> per-channel absmax (lists)
    alphas: dict = field(default_factory=dict)  # SmoothQuant alpha="auto": module -> alpha (None: not smoothed)
    fingerprint: dict = field(default_factory=dict)  # the float model's state_dict names -> shapes


class QuantizedGraph(nn.Module):
    """A pt2e-quantized model: the converted graph behind the original's call signature."""

    def __init__(self, graph: nn.Module, info: QuantInfo):
        super().__init__()
        self.graph = graph
        self.kiln_quant = info
        for m in self.modules():  # flags only: exported graphs raise on .eval()
            m.training = False
        # pt2e binds train/eval overrides to the converted graph as local functions, which pickle cannot
        # save (torch.save of a quantized model raised "Can't pickle local object ...", a new-user probe,
        # fiftieth session); this wrapper never switches the graph's mode (train() below), so they go
        for name in ("train", "eval"):
            graph.__dict__.pop(name, None)

    def forward(self, *args, **kwargs):
        try:
            return self.graph(*args, **kwargs)
        except TypeError as e:
            a, k = self.kiln_quant.sample or ((), {})
            raise TypeError(f"{e}. A pt2e-quantized model takes the arguments it was calibrated with: "
                            f"{len(a)} positional and keywords {sorted(k)}") from e
        except (AssertionError, IndexError) as e:
            # torch.export's shape guards ("Guard failed: input.size()[1] == 64") name no argument
            guard = isinstance(e, IndexError) or "Guard failed" in str(e)
            want, got = inputs.shapes(*(self.kiln_quant.sample or ((), {}))), inputs.shapes(args, kwargs)
            if not guard or got == want:
                raise
            raise ValueError(f"this {self.kiln_quant.config.scheme} model was exported for inputs shaped "
                             f"{want} (dimensions other than the batch are fixed, as is each input's rank); got "
                             f"{got}. Quantize with calib_data shaped like the inputs it will serve") from e

    def __reduce_ex__(self, protocol):
        # torch.export (2.9+) puts the input guards in a submodule whose forward is a local function, which
        # pickle cannot save: it raised "Can't pickle local object 'wrap_dunder_call_ctx_manager...'" (a new-
        # user probe, fiftieth session). Said plainly, with the way that works; deepcopy still copies.
        if any(isinstance(m.__dict__.get("forward"), types.FunctionType) for m in self.graph.modules()):
            raise TypeError(f"a {self.kiln_quant.config.scheme}-quantized model holds torch.export's guard "
                            "function, which pickle (and torch.save of the model object) cannot save: "
                            "tk.quantization.save(model, path) writes it without pickle, and "
                            "tk.quantization.load(float_model, path) reads it back")
        return super().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # what copy.deepcopy does for any object, past the refusal above (deepcopy copies functions as they are)
        return copy._reconstruct(self, memo, *object.__reduce_ex__(self, 4))

    def train(self, mode: bool = True):
        # An exported graph has no train/eval switch (torch raises on it): it was converted
        # for inference. Only this wrapper's flag changes.
        self.training = mode
        return self

    def _apply(self, fn, *args, **kwargs):
        # .half(), .to(dtype), .cuda(), ...: the converted graph runs the int8 kernels it was lowered
        # for, around float32 it was exported in, on that device. A cast changed its float weights in
        # place and every later call raised a dtype mismatch, from any input (a new-user probe,
        # thirty-seventh session). Judged on an empty tensor of each kind it holds: no-ops pass.
        for dtype, device in {(t.dtype, t.device) for t in tensors(self.graph)}:
            probe = torch.empty(0, dtype=dtype, device=device)
            out = fn(probe)
            if out is not probe and (out.dtype != dtype or out.device != device):
                raise RuntimeError(
                    f"this {self.kiln_quant.config.scheme} model is a graph lowered for {dtype_name(dtype)} on "
                    f"{device}; casting or moving it (to {dtype_name(out.dtype)} on {out.device}) would break "
                    "it. Quantize the floating-point model there instead: tk.quantize(model.to(...), ...)")
        return self


class Prepared(nn.Module):
    """Calling it calibrates: pt2e observers record ranges; every flow keeps the first
    batches for the accuracy report and auto_fallback."""

    def __init__(self, model: nn.Module, config: QuantConfig, backend: str, device: torch.device,
                 sample: inputs.Args | None):
        super().__init__()
        self.float_model = model
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "sample", sample)
        object.__setattr__(self, "seen", [])
        object.__setattr__(self, "smoothing", {})
        object.__setattr__(self, "alphas", {})  # alpha="auto": module -> chosen alpha (None: not smoothed)
        object.__setattr__(self, "codes", {})  # gptq=True: module -> its layer's codes (kept across fallback trials)
        self.observed = None
        if backend == "pt2e":
            if sample is None:
                raise ValueError(f"scheme {config.scheme!r} needs example_inputs (or calib_data) to export the model")
            self.observed = _observed(model, config, sample, device, self.smoothing_for)

    def smoothing_for(self, model_copy: nn.Module, data=None) -> None:
        """SmoothQuant: measure per-channel activation maxima on ``data`` (default: the sample)
        with the float model, then smooth ``model_copy``'s linears."""
        if self.config.scheme != "int8-smoothquant":
            return
        auto = self.config.alpha == "auto"
        if not self.smoothing:
            names = [n for n in fallback.targets(self.float_model, self.config, "torchao") if n not in self.config.keep]
            amax, rows = smoothquant.activation_stats(self.float_model, data or [self.sample], names, self.device,
                                                      smoothquant.ROWS if auto else 0)
            self.smoothing.update({n: v.tolist() for n, v in amax.items()})
            if auto:
                mods = dict(self.float_model.named_modules())
                # fewer rows kept than ROWS: they are every calibration row, and are scored held out
                self.alphas.update({n: smoothquant.choose_alpha(mods[n], rows[n], amax[n],
                                                                held_out=len(rows[n]) < smoothquant.ROWS)
                                    for n in amax})
        amax = {n: torch.tensor(v) for n, v in self.smoothing.items() if n not in self.config.keep}
        smoothquant.smooth(model_copy, amax, self.alphas if auto else self.config.alpha)

    def forward(self, *args, **kwargs):
        if len(self.seen) < RECORDED:
            self.seen.append(_detach((args, kwargs)))
        a, k = inputs.to((args, kwargs), self.device)
        with torch.no_grad():
            if self.observed is not None:
                return self.observed(*a, **k)
            return self.float_model(*a, **k)

    def calibration(self) -> dict:
        """The observers' state (JSON-ready): save it with json.dump, restore with load_calibration."""
        return pt2e_flow.observer_state(self.observed) if self.observed is not None else {}

    def load_calibration(self, state: dict) -> None:
        if self.observed is None:
            raise ValueError(f"{self.config.scheme} via {self.backend} has no calibration to load")
        pt2e_flow.load_observer_state(self.observed, state)


def _detach(args: inputs.Args) -> inputs.Args:
    return inputs.detach(args)


def _observed(model, config, sample, device, smooth, merge_linears: bool = True) -> nn.Module:
    m = copy.deepcopy(model).eval()
    smooth(m)
    observed, _ = pt2e_flow.prepare(m, config, inputs.to(sample, device), merge_linears)
    return observed


def prepare(model: nn.Module, config="int8-static", example_inputs=None, device=None, **options) -> Prepared:
    """Step one of the IPEX-style flow: returns a model that calibrates when called."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare() expects a torch.nn.Module, got {type(model).__name__}")
    _refuse_quantized(model, config)
    _refuse_training(model, "torchkiln.quantization.prepare")
    config = make(config, **options)
    dev = resolve_device(device) if device is not None else model_device(model)  # a clear error if not usable
    config = _keep_under(model, config, fallback.targets(model, config, _backend(config, dev, model)))
    sample = inputs.normalize(example_inputs) if example_inputs is not None else None
    return _prepare(model, config, sample, dev)


def _backend(config: QuantConfig, dev: torch.device, model: nn.Module) -> str:
    """schemes.backend_for for this model; a causal LM is refused the pt2e flow with a clear error
    (export raised an opaque pytree error on transformers' cache, and the graph it makes has no generate())."""
    generates = is_causal_lm(model)
    backend = backend_for(config, dev, model_dtype(model), generates)
    if backend == "pt2e" and generates:
        raise ValueError(f"scheme {config.scheme!r} quantizes through torch.export (pt2e), which turns "
                         f"{type(model).__name__}'s forward into a graph without generate(); for a causal LM use "
                         "'int8-dynamic', 'int8-weight-only' or 'int4-weight-only' (or tk.llm.optimize(model, "
                         "quant='int8'), the fast decoder)")
    if generates and backend == "torchao" and config.scheme == "int8-dynamic" and dev.type == "cpu":
        warn_once(f"lm-int8dyn:{type(model).__name__}", "torchkiln: int8-dynamic on a causal LM on the CPU runs "
                  "through torchao's int8 matmul (torch._int_mm, a reference loop on CPUs) to keep generate(): "
                  "correct but slow; 'int8-weight-only' or tk.llm.optimize(model, quant='int8') is the fast int8 here")
    return backend


def _prepare(model: nn.Module, config: QuantConfig, sample: inputs.Args | None, dev: torch.device) -> Prepared:
    dtype = model_dtype(model)
    _check_fast(config, dev, dtype)
    was_training = model.training
    model.eval()
    try:
        return Prepared(model, config, _backend(config, dev, model), dev, sample)
    finally:
        model.train(was_training)


def convert(prepared: Prepared, eval_data=None, progress: bool = True) -> nn.Module:
    """Step two: the quantized model (``.kiln_quant`` holds the config and accuracy report)."""
    if not isinstance(prepared, Prepared):
        raise TypeError(f"convert() expects the result of tk.quantization.prepare(), got {type(prepared).__name__}")
    config = prepared.config
    data = prepared.seen
    if config.needs_calibration and not data and not getattr(prepared, "calibrated_from_file", False):
        raise ValueError(f"scheme {config.scheme!r} needs calibration: call the prepared model on some batches "
                         "(or pass calib_data= to tk.quantize) before convert()")
    config = _resolved(config, prepared.backend, bool(data))
    evals, on = _evals(data, eval_data, prepared.sample, config)
    return _convert(prepared, config, data, evals, progress, first=True, measured_on=on)


def _in_sample(config: QuantConfig) -> str:
    """A calibrated scheme measured on its own calibration batches reads optimistic (static int8's
    ranges then clip nothing): on held-out batches a new-user sweep read 12-17 dB lower SQNR. The
    issue asks for the calibration inputs by default, and holding some out of calibration cost the
    served model accuracy (a test MLP calibrated on 3 of 4 batches: 31.3 against 38.4 dB on new data),
    so the report says which it measured."""
    if config.needs_calibration:
        return "the calibration batches themselves: optimistic for a calibrated scheme; pass eval_data="
    return "calib_data (this scheme does not calibrate on it)"


def _evals(data: list, eval_data, sample, config: QuantConfig) -> tuple[list, str]:
    """The batches accuracy is measured on, and what they are."""
    if eval_data is not None:
        return calibrate.batches(eval_data, "eval_data"), "eval_data"
    if data:
        return data[:EVAL_BATCHES], _in_sample(config)
    return ([sample], "the export sample") if sample is not None else ([], "")


@quiet_deprecations()  # torch's notices from what it runs are not the caller's (_log.py)
def quantize(model: nn.Module, scheme, calib_data=None, sample_input=None, eval_data=None, device=None,
             progress: bool = True, **options) -> nn.Module:
    """Quantize a copy of ``model``; see the module docstring and docs/quantization.md."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize() expects a torch.nn.Module, got {type(model).__name__}")
    _refuse_quantized(model, scheme)
    _refuse_training(model, "tk.quantize")
    config = make(scheme, **options)
    data = calibrate.batches(calib_data, "calib_data")
    if config.needs_calibration and not data:
        what = "chooses its rounding from the inputs (gptq=True)" if config.gptq else "calibrates activation ranges"
        raise ValueError(f"scheme {config.scheme!r} {what}: calib_data must hold at least one batch (a list of "
                         "tensors, tuples or dicts), got " + ("nothing" if calib_data is None else "an empty iterable"))
    dev = resolve_device(device) if device is not None else model_device(model)  # a clear error if not usable
    backend = _backend(config, dev, model)
    config = _resolved(config, backend, bool(data))
    names = fallback.targets(model, config, backend)
    if not names:
        warn_once(f"noquant:{type(model).__name__}:{config.scheme}", f"torchkiln: {type(model).__name__} has no layer "
                  f"{config.scheme} quantizes (nn.Linear{', nn.Conv' if config.static else ''})"
                  f"{_why_none(model, config)}; returned unchanged")
        return model
    config = _keep_under(model, config, names)
    sample = inputs.normalize(sample_input) if sample_input is not None else (data[0] if data else None)
    calibrate.check_fits(model, data)
    if sample_input is not None:
        calibrate.check_fits(model, [sample], "sample_input")
    if backend == "pt2e" and sample is None:
        raise ValueError(f"scheme {config.scheme!r} exports the model (torch.export), which needs one example "
                         "batch: pass sample_input=... (a tensor, a tuple of arguments or a dict of keyword "
                         "arguments) or calib_data=[...]")
    if backend == "pt2e":  # export's own error for a batch the model rejects is unreadable
        calibrate.check_runs(model, sample, "sample_input" if sample_input is not None else "calib_data")
    evals, on = _evals(data, eval_data, sample, config)
    if eval_data is not None:
        calibrate.check_fits(model, evals, "eval_data")
    prepared = _prepare(model, config, sample, dev)
    if prepared.backend == "pt2e" and config.scheme == "int8-smoothquant":
        prepared = _resmoothed(prepared, data)
    calibrate.run(prepared, data, "cpu", "calibrating", show=progress)  # Prepared moves batches itself
    return _convert(prepared, prepared.config, data, evals, progress, first=True, measured_on=on)


def _refuse_training(model: nn.Module, call: str) -> None:
    """Calibrating in training mode updated the caller's BatchNorm statistics and baked the drifted ones
    into the quantized model, whose report then compared against them (a new-user probe, thirty-seventh
    session)."""
    training = training_module(model)
    if training is not None:
        where = "the model" if training == "" else f"submodule {training!r}"
        raise ValueError(f"{where} is in training mode: quantization serves inference, and calibrating in "
                         "training mode would update the caller's BatchNorm running statistics (and quantize "
                         f"dropout's random outputs). Call model.eval() before {call}(model, ...)")


def _refuse_quantized(model: nn.Module, scheme) -> None:
    done = _quantized_already(model)
    if done:
        raise ValueError(f"the model is quantized already ({done}): quantize the floating-point model instead "
                         f"(tk.quantize(float_model, {getattr(scheme, 'scheme', scheme)!r}, ...))")


def _quantized_already(model: nn.Module) -> str | None:
    """What says ``model`` holds quantized layers: tk.quantize's output, or weights that are tensor
    subclasses (torchao's). Quantized again, torchao failed deep inside ("Int8Tensor dispatch:
    attempting to run unimplemented operator ... aten.view")."""
    if "kiln_quant" in vars(model):
        return f"tk.quantize made it: {model.kiln_quant.config.scheme}"
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            if type(p) not in (torch.Tensor, nn.Parameter):
                return f"{name or 'the model'}'s weight is a {type(p).__name__}"
    return None


def _keep_under(model: nn.Module, config: QuantConfig, names: list[str]) -> QuantConfig:
    """``keep`` checked against the model's module names (an unknown one was silently ignored), and a
    module that holds quantizable layers (``keep=["encoder.layer.0"]``) keeps each of them: the
    weight-only flows matched ``keep`` to the layers' own names only."""
    if not config.keep:
        return config
    mods = dict(model.named_modules())
    unknown = [k for k in config.keep if k not in mods]
    if unknown:
        import difflib

        close = sorted({c for k in unknown for c in difflib.get_close_matches(k, list(mods), n=3)})
        raise ValueError(f"keep={list(config.keep)!r}: {unknown} is not a module name of {type(model).__name__}"
                         + (f"; close: {close}" if close else "")
                         + f"; the layers {config.scheme} quantizes are named like {names[:3]}")
    under = [n for n in names if n not in config.keep and any(k == "" or n.startswith(k + ".") for k in config.keep)]
    return config.replace(keep=config.keep + tuple(under)) if under else config


def _why_none(model: nn.Module, config: QuantConfig) -> str:
    """Why int4-weight-only took none of a model's linears: their shapes, and a group size that fits."""
    lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if config.scheme != "int4-weight-only" or not lins:
        return ""
    shapes = sorted({(m.out_features, m.in_features) for m in lins})
    fits = [g for g in GROUP_SIZES if any(k % g == 0 and n % 16 == 0 for n, k in shapes)]
    tip = f"; group_size={max(fits)} would take some" if fits and max(fits) != config.group_size else ""
    return (f": its {len(lins)} linears (out x in {', '.join(f'{n}x{k}' for n, k in shapes[:4])}) need in_features "
            f"a multiple of group_size={config.group_size} and out_features a multiple of 16{tip}")


def _resolved(config: QuantConfig, backend: str, calibrated: bool) -> QuantConfig:
    """gptq=None made concrete: on for int4-weight-only with calibration data on torchkiln's layers."""
    if config.gptq is not None:
        return config
    return config.replace(gptq=config.scheme == "int4-weight-only" and backend == "kernels" and calibrated)


def _resmoothed(prepared: Prepared, data) -> Prepared:
    # SmoothQuant's maxima come from all calibration data, not the export sample alone.
    prepared.smoothing.clear()
    prepared.alphas.clear()
    prepared.smoothing_for(copy.deepcopy(prepared.float_model).eval(), data)
    object.__setattr__(prepared, "seen", [])
    prepared.observed = _observed(prepared.float_model, prepared.config, prepared.sample, prepared.device,
                                  prepared.smoothing_for)
    return prepared


def _convert(prepared: Prepared, config: QuantConfig, data, evals, progress: bool, first: bool,
             measured_on: str = "") -> nn.Module:
    model = prepared.float_model
    was_training = model.training
    model.eval()
    try:
        what = "eval_data" if measured_on == "eval_data" else "fp32 reference"  # a bad eval batch names eval_data
        refs = calibrate.run(model, evals, prepared.device, what, show=False) if evals else []
        qmodel, report = _attempt(prepared, config, data, evals, refs, progress, reuse=first)
        if not report.passed and config.auto_fallback and evals:
            qmodel, report = _fall_back(prepared, config, data, evals, refs, progress, qmodel, report)
        report.measured_on = measured_on if evals else ""
        if not report.passed and evals:
            warn_once(f"acc:{config.scheme}:{type(model).__name__}",
                      f"torchkiln: {config.scheme} reaches {report.min_sqnr:.1f} dB, below its {report.threshold_db:g} "
                      f"dB bar, even with {len(report.kept)} layer(s) kept in floating point; see .kiln_quant.report")
    finally:
        model.train(was_training)
    return qmodel


def _attempt(prepared: Prepared, config: QuantConfig, data, evals, refs, progress: bool, reuse: bool):
    model, backend, dev = prepared.float_model, prepared.backend, prepared.device
    info = QuantInfo(config, backend, AccuracyReport(config.scheme, backend, config.threshold, len(evals)),
                     fingerprint={k: list(v.shape) for k, v in model.state_dict().items()})
    if backend == "pt2e":
        observed = prepared.observed if reuse else None
        if observed is None:
            observed = _observed(model, config, prepared.sample, dev, prepared.smoothing_for)
            calibrate.run(observed, data, dev, f"re-calibrating ({len(config.keep)} kept)", show=progress)
        info.calibration = pt2e_flow.observer_state(observed)
        info.sample = _detach(prepared.sample)
        info.smoothing = dict(prepared.smoothing)
        info.alphas = dict(prepared.alphas)
        qmodel = QuantizedGraph(pt2e_flow.convert(observed), info)
    else:
        qmodel = copy.deepcopy(model).eval()
        apply_layers(qmodel, config, dev, backend, _gptq_codes(prepared, config, data, progress))
        qmodel.kiln_quant = info
    names = fallback.targets(model, config, backend)
    info.report.kept = [n for n in names if n in config.keep] + [n for n in config.keep if n not in names]
    info.report.quantized = len([n for n in names if n not in config.keep])
    if evals:
        outs = calibrate.run(qmodel, evals, dev, "measuring accuracy", show=False)
        info.report.outputs = measure(refs, outs, [padding_mask(b) for b in evals])
    return qmodel, info.report


def _gptq_codes(prepared: Prepared, config: QuantConfig, data, progress: bool) -> dict | None:
    """gptq=True: the codes of every layer quantized, computed once per layer (fallback trials reuse them)."""
    if not config.gptq:
        return None
    names = [n for n in fallback.targets(prepared.float_model, config, "kernels")
             if n not in config.keep and n not in prepared.codes]
    if names:
        prepared.codes.update(gptq.codes_for(prepared.float_model, names, config.scheme, config.group_size, data,
                                             prepared.device, show=progress))
    return prepared.codes


def apply_layers(model: nn.Module, config: QuantConfig, device: torch.device, backend: str,
                 codes: dict | None = None) -> None:
    """Quantize ``model``'s layers in place (torchkiln's copy) with a layer-swapping backend:
    torchkiln's weight-only layers ("kernels", with GPTQ's ``codes`` where given) or torchao's
    quantize_ ("torchao")."""
    if backend == "kernels":
        weight_only.apply(model, config, device, codes)
    else:
        apply_torchao(model, config, device)


def apply_torchao(model: nn.Module, config: QuantConfig, device: torch.device) -> None:
    """torchao's quantize_ on ``model`` (torchkiln's copy), skipping the kept modules."""
    q = torchao()
    names = set(fallback.targets(model, config, "torchao")) - set(config.keep)
    with _quiet_torchao():
        q.quantize_(model, torchao_config(config, device), filter_fn=lambda m, fqn: fqn in names)


def _fall_back(prepared, config, data, evals, refs, progress, qmodel, report):
    model = prepared.float_model
    names = [n for n in fallback.targets(model, config, prepared.backend) if n not in config.keep]
    sens = fallback.sensitivity(model, config, prepared.backend, data[:2] or evals[:2], prepared.device, names)
    order = fallback.ranked(sens)
    best = (qmodel, report)
    for worst in fallback.keep_steps(order, max(1, int(len(names) * config.max_keep_fraction))):
        trial = config.replace(keep=config.keep + tuple(worst))
        log.info("torchkiln: %s at %.1f dB; keeping %d layer(s) in floating point", config.scheme,
                 best[1].min_sqnr, len(worst))
        qm, rep = _attempt(prepared, trial, data, evals, refs, progress, reuse=False)
        rep.auto_kept = list(worst)
        rep.notes.append("auto_fallback: layer SQNR (simulated) of the kept: "
                         + ", ".join(f"{n} {sens[n]:.1f} dB" for n in worst[:8]) + (" ..." if len(worst) > 8 else ""))
        if rep.min_sqnr > best[1].min_sqnr:
            best = (qm, rep)
        if rep.passed:
            break
    return best


def info(model: nn.Module) -> QuantInfo | None:
    """The QuantInfo of a model tk.quantize returned (None for any other model)."""
    return getattr(model, "kiln_quant", None) if isinstance(getattr(model, "kiln_quant", None), QuantInfo) else None


def _check_fast(config: QuantConfig, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """A scheme without a fast kernel here warns; fp8 without one cannot run at all (torchao's own
    assertion would be the error), so it raises."""
    from ..hardware import detect

    fast, why = fast_here(config.scheme, device, detect(), dtype)
    if not fast and config.scheme == "fp8":
        raise ValueError(f"scheme='fp8' cannot run on {device}: {why}")
    if not fast:
        warn_once(f"slow:{config.scheme}:{device.type}",
                  f"torchkiln: {config.scheme} has no fast kernel on this {device.type}: {why}")
