"""tk.llm.optimize: a copy of a Hugging Face decoder whose generate() is the fast path.

The returned object is the model's own class (isinstance, pipelines, save_pretrained,
state_dict and load_state_dict all as before); only its ``generate`` is the fast one, set on
this copy alone (no class or library is patched). Nothing here touches the caller's model,
unless ``inplace=True`` asks for it to be converted instead of copied (IPEX's meaning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
import time

import torch
from torch import nn

from .. import _log, hostmem
from .._log import quiet_deprecations, warn_once
from ..inputs import out_of_inference
from ..modelutil import copy_with, first_line, is_oom, model_device, model_dtype, parse_dtype
from ..quantization import calibrate
from . import decode_attention, fused, qkv_rope
from .generate import Fallback, inferred_mask, resolve, run
from .model import FastDecoder, cpu_projections, cublas_projections, cuda_projections
from .quant import MMA_KERNEL, cpu_int8_rows, gptq_codes, head_kind, int4_kernels
from .quant import quantize as quantize_decoder
from .runner import Runner
from .spec import NORM_PLACES, ROPE_PAIRS, ROTARY_ON, Unsupported, read

log = logging.getLogger(__name__)
QUANT = {"int8": "int8-weight-only", "int4": "int4-weight-only"}
FAMILIES = "Llama, Mistral, Qwen2/Qwen3, Phi-3, Gemma, GPT-2, GPT-NeoX, OPT and others built the same way"
# The verify check catches a misread structure (a wrong norm, rotary or projection split
# gives errors of order 1), not kernel rounding: half-precision logits of two correct
# implementations differ too, 4.9% (relative L2) for random-init Llama-3-8B in bf16 on the
# H200 (benchmarks/RESULTS.md, LLM decode), so half precision gets room above that.
# In float32 the issue's own exactness bound (1e-4, per-step logits): two correct implementations differ by
# ~1e-6 there (llama-125m: 9.2e-7), while a misread Helium on small random weights passed 1e-3 at 2e-4 (a
# new-user probe, fiftieth session).
VERIFY_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.1}


@dataclasses.dataclass
class LLMReport:
    path: str                       # "fast" or "stock" (the model's own generate, static cache)
    reason: str                     # why the stock path (empty on the fast path)
    device: str
    dtype: str
    quant: str | None
    compile: bool
    cudagraphs: bool
    spec: dict | None = None
    verify_error: float | None = None    # max relative L2 error of logits vs the model's forward
    structure_error: float | None = None  # the same check in float32, where the reading was decided (_structure)
    quant_cosine: float | None = None    # quantized vs float logits on the verify prompt
    quant_layers: int | None = None      # Linears quantized (the head too where the CUDA GEMVs run)
    quant_rounding: str | None = None    # "gptq" (calib_data given), "nearest", or "gptq (N of M ... nearest ...)"
    quant_head: str | None = None        # the output head's weights: "int8", "int4" (llm/quant.py INT4_HEAD), "float"
    setup_s: float = 0.0
    compile_s: list = dataclasses.field(default_factory=list)
    cache: dict | None = None
    speculated: int = 0                  # prompt-lookup steps run (generate(prompt_lookup_num_tokens=k))
    accepted: int = 0                    # drafted tokens they kept
    fallbacks: list = dataclasses.field(default_factory=list)
    cpu_gemv: str | None = None          # CPU compiled decode's one-row form, measured: "F.linear", "reduction"
                                         # (RowLinear) or "kernel" (KernelLinear); int8: "torch" or "kernel"
    cuda_gemv: str | None = None         # CUDA decode's o/down projections, measured: "cuBLAS" or "triton"
                                         # (quantization/gemv.py's float GEMV), with the times
    attention: str | None = None         # the decode step's one-query attention: "kernel" (CUDA,
                                         # llm/decode_attention.py), "matmul" (CPU) or "sdpa"
    folded: int | None = None            # int8/int4 CUDA decode: layers whose norms, residual adds and silu * up
                                         # run inside the GEMVs (llm/fused.py)
    rope: int | None = None              # CUDA one-row decode: layers whose RoPE and KV-cache writes run in
                                         # llm/qkv_rope.py's kernels (in the int8 q/k/v GEMV where folded)
    wrapper: str | None = None           # the compiled decode step's wrapper: "C++" (CPU) or "Python"
    int4_kernel: str | None = None       # quant='int4': the kernels serving its layers (llm/quant.py INT4_IMPL)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"torchkiln.llm: {self.path} path on {self.device}, {self.dtype}"
                 + (f", weight-only {self.quant}" if self.quant else "")]
        if self.reason:
            lines.append(f"  why not fast: {self.reason}")
        if self.path == "fast":
            lines.append(f"  compiled decode: {self.compile} (CUDA graphs: {self.cudagraphs}; wrapper: "
                         f"{self.wrapper or 'not yet'}); compile s: {self.compile_s or 'not yet'}")
            lines.append(f"  verified against the model's forward: max rel error {self.verify_error:.2e}")
            if self.structure_error is not None:
                lines.append(f"  structure checked in float32: max rel error {self.structure_error:.2e}")
            lines.append(f"  decode attention: {self.attention}")
            if self.cpu_gemv:
                lines.append(f"  CPU decode projections: {self.cpu_gemv}")
            if self.cuda_gemv:
                lines.append(f"  CUDA decode projections: {self.cuda_gemv}")
            if self.quant:
                cos = "not measured" if self.quant_cosine is None else f"{self.quant_cosine:.4f}"
                lines.append(f"  quantized Linears: {self.quant_layers} (output head: {self.quant_head}); "
                             f"logits cosine against the float decoder: {cos}")
            if self.int4_kernel:
                lines.append(f"  int4 kernel: {self.int4_kernel}")
            if self.folded is not None:
                lines.append(f"  quantized decode layers with norms, residuals and silu * up inside the GEMVs: "
                             f"{self.folded}")
            if self.rope is not None:
                lines.append(f"  decode layers with RoPE and the cache writes in one kernel: {self.rope}")
        for f in self.fallbacks:
            lines.append(f"  fallback: {f}")
        return "\n".join(lines)


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a Hugging Face ...ForCausalLM nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "generate", None)):
        raise ValueError(f"{type(model).__name__} is not a Hugging Face generation model; tk.llm.optimize takes "
                         f"decoder-only causal LMs ({FAMILIES}), e.g. AutoModelForCausalLM.from_pretrained(...)")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; tk.llm.optimize takes decoder-only "
                         f"causal LMs ({FAMILIES}). Use tk.optimize(model) for its forward")
    can = getattr(model, "can_generate", None)
    if model.get_output_embeddings() is None or (callable(can) and not can()):
        raise ValueError(f"{type(model).__name__} has no language-model head (an encoder or base model); "
                         f"tk.llm.optimize takes decoder-only causal LMs ({FAMILIES}). Use tk.optimize(model) "
                         "for its forward")


def _copy_as(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``copy.deepcopy(model).to(device, dtype)`` without the full copy in the model's own dtype first:
    each tensor is copied straight into its new dtype and device (through deepcopy's memo, so tied
    weights stay tied). A float32 llama-1b served in bf16 on the CPU peaked at 12.0 GB that way
    (5.6 GB of weights: the model, its float32 copy, the casts); see docs/llm.md for the figure now."""
    return copy_with(model, lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else None, copy=True),
                     plain_only=True)


def _device(model, device) -> torch.device:
    from ..hardware import resolve_device

    return resolve_device(device if device is not None else model_device(model))


def _auto_dtype(model, device: torch.device) -> torch.dtype:
    """bf16 where the hardware runs it natively, else the model's own dtype."""
    own = model_dtype(model)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else own
    if device.type == "cpu":
        from ..hardware import detect

        return torch.bfloat16 if detect().cpu.bf16_native else own
    return own


# CUDA int4 decode of this many rows ran slower than bf16 through tinygemm: at Llama-3-8B's shapes
# 0.69-0.78x cuBLAS bf16 at 8 rows, 1.1-1.3x at 4 (benchmarks/diag_rows.py, RESULTS.md "int4 and int8 at
# batch > 1"); optimize() warns when max_batch_size reaches it and torchkiln's CUDA kernel does not
# serve the layers (it takes 8 rows in one pass over the weights, its MMA's 8 columns)
INT4_SLOW_ROWS = 8


# ipex.llm.optimize's other keywords (IPEX 2.8). Its documented call is
# ``ipex.llm.optimize(model.eval(), dtype=torch.bfloat16, inplace=True, deployment_mode=True)``,
# which raised "unexpected keyword" here: the migration is one import line only if these are taken.
IPEX_NO_EFFECT = {
    "deployment_mode": "the fast path is always the deployment one (a traced, compiled decode step)",
    "sample_inputs": "shapes are read from the model's config",
    "cache_weight_for_large_batch": "no second copy of the weights is kept for large batches",
}
IPEX_INSTEAD = {
    "optimizer": "tk.llm.optimize serves inference; to train, tk.optimize(model.train(), optimizer=opt, dtype=...)",
    "quantization_config": "IPEX's qconfig objects are Intel-only; pass quant='int8' or quant='int4' (weight-only), "
                           "with calib_data= for GPTQ rounding",
    "qconfig_summary_file": "static int8 of a whole LLM is not offered; pass quant='int8' or 'int4' (weight-only)",
    "low_precision_checkpoint": "load the model with transformers, then pass quant='int8' or 'int4' (with calib_data= "
                                "for GPTQ rounding)",
}


def _ipex_keywords(ipex: dict) -> None:
    unknown = sorted(set(ipex) - set(IPEX_NO_EFFECT) - set(IPEX_INSTEAD))
    if unknown:
        raise TypeError(f"tk.llm.optimize() got unknown keyword(s) {unknown}; it takes dtype, quant, max_seq_len, "
                        "max_batch_size, device, compile, calib_data, inplace, and ipex.llm.optimize's "
                        f"{sorted([*IPEX_NO_EFFECT, *IPEX_INSTEAD])}")
    for k, v in ipex.items():
        if k in IPEX_INSTEAD and v is not None:
            raise ValueError(f"{k}= (ipex.llm.optimize's) is not supported: {IPEX_INSTEAD[k]}")
        if k in IPEX_NO_EFFECT:
            warn_once(f"llm-ipex:{k}", f"torchkiln.llm: {k}= accepted with no effect: {IPEX_NO_EFFECT[k]}")


@quiet_deprecations()  # torch's notices from what it runs are not the caller's (_log.py)
def optimize(model, dtype=None, quant=None, max_seq_len=None, max_batch_size=1, device=None,
             compile: bool = True, calib_data=None, inplace: bool = False, **ipex):
    """A copy of ``model`` (a decoder-only Hugging Face causal LM) with a fast ``generate``.

    inplace: True converts and returns ``model`` itself, with no copy (IPEX's ``inplace=True``): its
    weights are cast to ``dtype`` and moved to ``device`` in place and its ``generate`` is the fast one;
    the memory of a second model is not needed (llama-1b in bf16 on the CPU: 2.8 GB of weights, the
    copy took the process from 3.2 to 6.0 GB). ipex.llm.optimize's other keywords are accepted
    (``deployment_mode``, ``sample_inputs``, ``cache_weight_for_large_batch``: no effect, said once)
    or refused with what to use instead (``optimizer``, ``quantization_config``, ...).

    dtype: None picks bf16 where the hardware runs it natively, else the model's dtype; an
    explicit dtype is honoured. quant: None, "int8" or "int4" (weight-only, through
    tk.quantization's layers). calib_data: with quant, token-id batches (tensors, or dicts with
    input_ids/attention_mask) from which GPTQ chooses the weights' rounding instead of rounding each
    to nearest (quantization/gptq.py). max_seq_len: the KV-cache length (None: grows with
    use, each new length compiles once). A model the fast path cannot read is returned
    working on the model's own generate with a static cache, with a warning saying why.
    """
    _log.configure()
    t0 = time.perf_counter()
    _check_model(model)
    _ipex_keywords(ipex)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace={inplace!r} must be True or False")
    if quant not in (None, *QUANT):
        raise ValueError(f"quant={quant!r} is not one of None, 'int8', 'int4' (weight-only)")
    if calib_data is not None and quant is None:
        raise ValueError("calib_data= chooses the rounding of quantized weights (GPTQ); pass quant='int8' or "
                         "'int4' with it, or drop calib_data")
    calib = calibrate.batches(calib_data, "calib_data")
    if calib_data is not None and not calib:
        raise ValueError("calib_data is empty; pass at least one batch of token ids, or None")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 2):
        raise ValueError(f"max_seq_len={max_seq_len!r} must be an int >= 2 (None: grow as needed)")
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size!r} must be an int >= 1")
    target = _device(model, device)
    dtype = _auto_dtype(model, target) if dtype is None else parse_dtype(dtype)
    cudagraphs = compile and target.type == "cuda"
    report = LLMReport("fast", "", str(target), str(dtype).removeprefix("torch."), quant, compile, cudagraphs)
    work = (model if inplace else _copy_as(model, target, dtype)).to(device=target, dtype=dtype).eval()
    for p in work.parameters():
        p.requires_grad_(False)
    try:
        runner = _build(work, target, dtype, quant, compile, max_seq_len, report, calib)
    except Unsupported as e:
        return _stock(work, report, str(e), t0)
    work._kiln_calib = calib  # for a rebuild after .to()
    runner.reserve(max_batch_size, min(max_seq_len or 256, runner.decoder.spec.max_positions))
    if quant == "int4" and target.type == "cuda" and max_batch_size >= INT4_SLOW_ROWS \
            and MMA_KERNEL not in (report.int4_kernel or ""):
        warn_once(f"llm-int4-batch:{max_batch_size}",
                  f"torchkiln.llm: quant='int4' with max_batch_size={max_batch_size}: on CUDA, int4 decode "
                  f"of {INT4_SLOW_ROWS} or more rows runs slower than bf16 (torch's int4 kernel makes about one "
                  "pass over the weights per 8-16 rows; Llama-3-8B on an H200 at batch 16: 9.4 ms per step "
                  "against bf16's 5.3 and int8's 4.5). quant='int8' serves batched decode faster", owner=work)
    work.kiln_report = report
    _attach(work, runner)
    work.generate = FastGenerate(work)
    report.setup_s = round(time.perf_counter() - t0, 2)
    return work


class StockGenerate:
    """The stock path's ``generate``: the model's own, with a static cache unless the call or its
    generation_config says which cache. Per call, not written into ``model.generation_config``:
    written there, ``save_pretrained`` saved it and every later load of the checkpoint used a static
    cache (a new-user probe, fiftieth session)."""

    def __init__(self, model):
        self.model = model
        self.__doc__ = type(model).generate.__doc__

    def __call__(self, *args, generation_config=None, **kwargs):
        chosen = getattr(generation_config or self.model.generation_config, "cache_implementation", None)
        if "cache_implementation" not in kwargs and chosen is None:
            kwargs["cache_implementation"] = "static"
        return type(self.model).generate(self.model, *args, generation_config=generation_config, **kwargs)

    def __reduce__(self):
        return StockGenerate, (self.model,)


def _attach(model, runner: Runner) -> None:
    """``runner`` serves ``model`` from now on, as the model is now (its weights' versions, its layout)."""
    model._kiln_runner = runner
    runner.versions = _versions(model)
    runner.layout = _layout(model)


class FastGenerate:
    """The model's ``generate``: the fast path (``_generate``). An object rather than a bound method so the
    model still pickles: ``torch.save(model)`` stored the bound method by its function's name, and
    ``torch.load`` then failed ("no attribute '_generate'", a new-user probe, fiftieth session). A
    loaded or copied model holds a FastGenerate without a decoder (Runner pickles to None): its first
    call builds, verifies and compiles again."""

    def __init__(self, model):
        self.model = model
        sig = inspect.signature(_generate)
        self.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])  # without the model
        self.__doc__ = _generate.__doc__

    def __call__(self, *args, **kwargs):
        return _generate(self.model, *args, **kwargs)

    def __reduce__(self):
        return FastGenerate, (self.model,)


def _build(work, target, dtype, quant, compile, max_seq_len, report: LLMReport, calib=()) -> Runner:
    """Read, build, verify (and quantize) the fast decoder over ``work``'s weights."""
    spec, parts = read(work, **_structure(work, target, dtype, report))
    if max_seq_len is not None and max_seq_len > spec.max_positions and spec.positions == "learned":
        raise ValueError(f"max_seq_len={max_seq_len} is more than the model's max_position_embeddings="
                         f"{spec.max_positions} (its learned position table has no more rows)")
    decoder = FastDecoder(spec, parts)
    report.attention = "matmul" if target.type == "cpu" else "sdpa"
    if decode_attention.wanted(target):
        report.attention = "kernel"
        rope = qkv_rope.ROPE and qkv_rope.fits(spec)
        if rope:
            qkv_rope.register()  # here: a compiled step cannot trace the registration
        for layer in decoder.layers:
            layer.decode_kernel = True
            layer.rope_kernel = rope
        report.rope = len(decoder.layers) if rope else 0
    if target.type == "cuda" and compile:
        cublas_projections(decoder)
        if quant is None:  # quantized, these layers are replaced below
            report.cuda_gemv = cuda_projections(decoder)
    elif target.type == "cpu" and compile:
        report.cpu_gemv = cpu_projections(decoder)
    runner = Runner(decoder, target, compile, compile and target.type == "cuda", max_seq_len, report)
    # an alias of the head weight: a real .to() gives the parameter new storage, the alias keeps
    # the old one; deepcopy clones each parameter on its own, which also shows here
    runner.anchor = (parts.head.weight, parts.head.weight.detach())
    report.spec = spec.to_dict()
    reference = _verify(work, runner, dtype, report)
    if quant is not None:
        short: list = []
        codes = gptq_codes(work, decoder, quant, calib, target, short) if calib else None
        report.quant_rounding = "gptq" if calib else "nearest"
        if codes is not None and short:  # calibration too short for those: rounded to nearest (gptq.py)
            report.quant_rounding = "nearest" if len(short) == len(codes) else \
                f"gptq ({len(short)} of {len(codes)} projections nearest: fewer calibration tokens than inputs)"
        report.quant_layers = quantize_decoder(decoder, quant, target, codes)
        report.int4_kernel, why = int4_kernels(decoder)
        if why:
            report.fallbacks.append(why)
            warn_once("llm-int4-kernel", f"torchkiln.llm: {why}", owner=work)
        if target.type == "cpu" and compile and quant == "int8":
            head = decoder.head
            report.cpu_gemv = "; ".join(filter(None, [report.cpu_gemv, cpu_int8_rows(decoder)]))
            report.quant_layers += decoder.head is not head  # the head went int8 with the kernel
        report.quant_head = head_kind(decoder.head)
        if target.type == "cuda" and fused.ON and (quant == "int8" or fused.INT4):
            report.folded = fused.fold(decoder)
        report.quant_cosine = _quant_cosine(work, runner, reference)
    return runner


# The float32 copy may take this share of the memory left (the rest: the forward and the decoder's checks).
FLOAT32_CHECK_SHARE = 0.5


def _structure(work, target, dtype, report: LLMReport) -> dict:
    """How the decoder is read, decided by building it in float32 and checking it against the model's
    forward there (_verify at 1e-4), before the served build. Returns the reading that passed, as ``read``'s
    keywords: which layers rotate, where a two-norm layer's norms sit and how the rotary dimensions pair up
    (spec.ROTARY_ON, spec.NORM_PLACES, spec.ROPE_PAIRS, tried in turn: all three are in the model's code,
    not its config).

    Why float32 for a decoder served in bf16/fp16: at bf16's tolerance (0.25: a correct decoder of a
    random 8B model is ~5% off there) a misread passed. SmolLM3 (its NoPE layers rotated), GLM and Helium
    (RoPE on interleaved pairs read as halves) went on the fast path in bf16 and decoded other tokens than
    the model (a family survey, fifty-third session), where float32 refused them at 0.03-0.18 against 1e-4.
    ``work``'s parameters are made float32 for the check and cast back after (bf16 -> float32 -> bf16 is
    exact). Where float32 weights would not fit, or the check runs out of
    memory, the check is the served build's own, said in ``fallbacks`` for bf16/fp16."""
    params = list(work.parameters())
    low = dtype in (torch.bfloat16, torch.float16)
    # bf16/fp16: float32 weights replace the served ones for the check (those freed, cast back after: exact), 4
    # bytes a parameter for 2; the checked decoder reads them in place (model.Side: no fused copy). float32:
    # nothing is copied; the bound leaves room for the activations
    need = (4 if low else 1) * sum(p.numel() for p in params)
    free = torch.cuda.mem_get_info(target)[0] if target.type == "cuda" else hostmem.available_bytes()
    if free is not None and need > FLOAT32_CHECK_SHARE * free:
        if low:
            report.fallbacks.append(f"structure checked in {report.dtype} only: float32 weights ({need / 1e9:.1f} "
                                    f"GB) do not fit in {FLOAT32_CHECK_SHARE:.0%} of the {free / 1e9:.1f} GB free")
        return {}
    dtypes = [p.dtype for p in params]
    errors = []  # (the reading, its error or None where the probe failed, the message)
    try:
        for p in params:
            p.data = p.data.float()
        for rotary_on, norms_at, pairs in itertools.product(ROTARY_ON, NORM_PLACES, ROPE_PAIRS):
            try:
                spec, parts = read(work, pairs=pairs, norms_at=norms_at, rotary_on=rotary_on)
            except Unsupported:
                if not errors:  # the first reading's own refusal is the one to say
                    raise
                continue  # the model has no such variant (post-norm of other than two norms, ...)
            if spec.positions != "rotary" and pairs != ROPE_PAIRS[0]:
                continue  # nothing rotates: the pairing changes nothing
            scratch = LLMReport("fast", "", report.device, "float32", None, False, False)
            try:
                _verify(work, Runner(FastDecoder(spec, parts, fused=False), target, False, False, None, scratch),
                        torch.float32, scratch)
            except Unsupported as e:
                if is_oom(e.__cause__):
                    raise e.__cause__ from None
                reading = f"{norms_at}-norm, {pairs} pairs" + (", rotary on sliding layers" if rotary_on == "sliding"
                                                               else "")
                errors.append((reading, scratch.verify_error, str(e)))
                continue
            report.structure_error = scratch.verify_error
            return dict(pairs=pairs, norms_at=norms_at, rotary_on=rotary_on)
    except Exception as e:  # noqa: BLE001
        # out of memory in this check, which the caller did not ask for: the served build's own check
        # decides, as before the check existed (elsewhere an OOM is the caller's: modelutil.is_oom)
        if not is_oom(e):
            raise
        report.fallbacks.append(f"structure checked in {report.dtype} only: the float32 check ran out of memory")
        return {}
    finally:  # the checked decoder reads the weights in place (model.Side): only their dtype to give back
        for p, dt in zip(params, dtypes, strict=True):
            p.data = p.data.to(dt)
    others = "; ".join(f"{reading}: {msg if err is None else f'{err:.2e}'}" for reading, err, msg in errors[1:])
    raise Unsupported(f"checked in float32: {errors[0][2]}" + (f" (read otherwise: {others})" if others else ""))


def _stock(work, report: LLMReport, reason: str, t0: float):
    """The model's own generate with a static cache (transformers compiles its forward then)."""
    report.path, report.reason, report.compile = "stock", reason, False
    report.cudagraphs = False
    warn_once(f"llm-stock:{type(work).__name__}", f"torchkiln.llm: {type(work).__name__} runs on transformers' own "
              f"generate with a static cache, not the fast path: {reason}")
    work.generate = StockGenerate(work)
    work.kiln_report = report
    report.setup_s = round(time.perf_counter() - t0, 2)
    return work


def _probe(spec_vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, spec_vocab, (1, 8), generator=g).to(device)


@torch.no_grad()
def _fast_logits(runner: Runner, ids: torch.Tensor, prompt: int) -> list:
    """The fast decoder's logits for positions prompt-1 .. end of ``ids`` (eager, one step at a time)."""
    d = runner.decoder
    runner.reserve(ids.shape[0], ids.shape[1])
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    out = [runner.prefill(ids[:, :prompt], torch.ones_like(ids[:, :prompt]), pos[:, :prompt], graph=False)]
    for t in range(prompt, ids.shape[1]):
        out.append(d(ids[:, t:t + 1], torch.tensor([t], device=ids.device), pos[:, t:t + 1]))
    return out


@torch.no_grad()
def _verify(work, runner: Runner, dtype, report: LLMReport) -> list:
    """The fast decoder against the model's own forward on one prompt: prefill and two decode
    steps. A structure read wrongly shows here, before any user call; it is then Unsupported."""
    ids = _probe(runner.decoder.spec.vocab, runner.device)
    prompt = ids.shape[1] - 2
    try:
        ref = work(input_ids=ids, use_cache=False).logits[:, prompt - 1:].float()
        got = _fast_logits(runner, ids, prompt)
    except Exception as e:  # noqa: BLE001 - a model the fast path misreads is served the stock way
        raise Unsupported(f"the fast decoder failed on a probe prompt ({first_line(e)})") from e
    err = max(float((g - ref[:, i]).norm() / ref[:, i].norm().clamp_min(1e-12)) for i, g in enumerate(got))
    report.verify_error = err
    if not err <= VERIFY_TOL.get(dtype, 1e-3):
        raise Unsupported(f"the fast decoder's logits differ from the model's forward by {err:.2e} relative "
                          f"(allowed {VERIFY_TOL.get(dtype, 1e-3):.0e}); its structure was not read correctly")
    return list(ref.unbind(1))


def _quant_cosine(work, runner: Runner, reference: list) -> float:
    ids = _probe(runner.decoder.spec.vocab, runner.device)
    got = _fast_logits(runner, ids, ids.shape[1] - 2)
    return min(float(torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0))
               for g, r in zip(got, reference, strict=False))


def _generate(self, inputs=None, generation_config=None, streamer=None, **kwargs):
    """transformers' generate, on the fast path; anything it does not do goes to the model's
    own generate with a warning naming the argument."""
    runner: Runner | None = self._kiln_runner
    report: LLMReport = self.kiln_report
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    mask = kwargs.get("attention_mask")
    rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
    try:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise Fallback("inputs= other than a (batch, length) tensor of token ids")
        rewritten = runner is not None and _rewritten(self, runner)
        if runner is None or _moved(runner) or _reshaped(self, runner) or (report.quant and rewritten):
            runner = _rebuild(self, runner, report)
        elif rewritten:
            _recheck(self, runner, report)
        if getattr(runner, "broken", None):
            raise Fallback(runner.broken)
        req = resolve(self, ids.shape[1], generation_config, rest)
        if mask is None:
            mask = inferred_mask(ids, req.pad, req.sampling.eos)
        # Out of inference mode (IPEX's run_generation.py and serving stacks generate under it): the steps
        # are compiled under no_grad (verify, or the first generate) and dynamo guards each input's
        # dispatch keys, which inference mode changes: every step was compiled again when the two mixed.
        with torch.inference_mode(False), torch.no_grad(), _autocast_off(runner, report):
            ids, mask = out_of_inference((ids, mask))
            seq, scores, logits = run(runner, ids, mask, req, streamer)
    except Fallback as f:
        report.fallbacks.append(f"generate({f}) -> the model's own generate")
        warn_once(f"llm-generate:{f}", f"torchkiln.llm: generate({f}) is not on the fast path; running the "
                  "model's own generate for this call")
        return type(self).generate(self, inputs, generation_config=generation_config, streamer=streamer, **kwargs)
    if not req.return_dict:
        return seq
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(sequences=seq, scores=tuple(scores) if req.output_scores else None,
                                     logits=tuple(logits) if req.output_logits else None)


def _autocast_off(runner: Runner, report: LLMReport):
    """IPEX's run_generation.py calls generate under ``torch.cpu.amp.autocast()``. The fast decoder
    computes in the dtype it was built and verified in, and the caller's autocast made torch.compile
    compile every step again at the first such call (a small bf16 llama: a 4.29 s generate of 16 tokens
    against 0.01 s; benchmarks/RESULTS.md, thirty-second session): autocast is off inside. At
    another dtype than that, it would change nothing on this path either: said once."""
    device = runner.device.type
    if not torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    asked = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
    if asked != report.dtype:
        warn_once(f"llm-autocast:{asked}", f"torchkiln.llm: generate() under torch.autocast({asked}) computes in "
                  f"{report.dtype}, the dtype tk.llm.optimize built and verified it in; tk.llm.optimize(model, "
                  f"dtype=torch.{asked}) decodes in {asked}")
    return torch.autocast(device, enabled=False)


def _rebuild(model, old: Runner | None, report: LLMReport) -> Runner:
    """After a real .to(), a deepcopy, a pickle round trip or a module replaced, the decoder no longer
    reads the model's weights: build it again over the model as it is now (verified and compiled again)."""
    target, dtype = model_device(model), model_dtype(model)
    compile, max_seq_len = (old.compile, old.max_seq_len) if old is not None else (report.compile, None)
    try:
        runner = _build(model, target, dtype, report.quant, compile, max_seq_len, report,
                        getattr(model, "_kiln_calib", ()))
    except Unsupported as e:
        raise Fallback(f"a model changed since tk.llm.optimize (now {target}/{dtype}) that the fast path cannot "
                       f"take ({e})") from e
    report.device, report.dtype = str(target), str(dtype).removeprefix("torch.")
    report.cudagraphs = runner.cudagraphs
    _attach(model, runner)
    log.info("torchkiln.llm: decoder rebuilt for %s/%s", target, dtype)
    return runner


def _moved(runner: Runner) -> bool:
    """The decoder reads the model's weights in place; a real .to() gives them new storage."""
    param, alias = runner.anchor
    return param.untyped_storage().data_ptr() != alias.untyped_storage().data_ptr()


def _versions(model: nn.Module) -> int:
    """The sum of the parameters' version counters. A quantized decoder holds codes made from the weights
    at build, which load_state_dict or an in-place edit of the weights leaves behind: generate() then
    decoded with the old weights, silently (found by a new-user probe). A float decoder reads the
    weights in place, but its check against the model's forward was made on the old values (_recheck).
    Counters only grow, so the sum moves exactly when one of them does. (Edits through ``.data`` bypass
    them.)"""
    return sum(p._version for p in model.parameters() if not p.is_inference())  # inference tensors keep none


def _layout(model: nn.Module) -> tuple:
    """Which modules and parameter tensors the model holds, and where their memory is. The decoder holds
    the modules and weights it read at build; a module replaced since (``resize_token_embeddings``, an
    adapter injected, a layer swapped by hand) or a weight given new memory (``p.data = t``) changed
    the model's forward while generate decoded on with the old ones, silently (a new-user probe,
    fiftieth session). Read once per generate call, not per token (~300 parameters for Llama-3-8B)."""
    return (tuple(map(id, model.modules())),
            tuple((id(p), p.data_ptr(), p.shape) for p in model.parameters()))


def _reshaped(model: nn.Module, runner: Runner) -> bool:
    """Modules or weight memory changed since the decoder was built (``_layout``): build again."""
    return getattr(runner, "layout", None) != _layout(model)


def _rewritten(model: nn.Module, runner: Runner) -> bool:
    """The weights were written in place since the decoder was built or last checked."""
    versions = getattr(runner, "versions", None)
    return versions is not None and versions != _versions(model)


def _recheck(model: nn.Module, runner: Runner, report: LLMReport) -> None:
    """A float decoder's weights were written in place (``load_state_dict``, an edit): its check against
    the model's forward again. Why: how much a misread structure shows depends on the weights. On small
    random weights a misread RoPE layout moved the logits by 2e-4 (Helium, Ernie 4.5), inside the check,
    and decoded other tokens than HF's after a checkpoint of real scale was loaded (a new-user probe,
    fiftieth session). Failing it, generate runs the model's own (``runner.broken`` says why) until the
    weights change again."""
    runner.versions = _versions(model)
    runner.broken = None
    try:
        _verify(model, runner, model_dtype(model), report)
    except Unsupported as e:
        runner.broken = f"the fast decoder, checked again after the weights changed: {e}"
        report.fallbacks.append(runner.broken)
