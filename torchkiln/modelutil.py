"""Small facts about a model that optimize, check and bench all need."""

from __future__ import annotations

import contextlib
import copy
import itertools

import torch
from torch import nn

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r} is not supported; use torch.float32, torch.bfloat16 or "
                     f"torch.float16 (or the strings {sorted(set(DTYPES))})")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_device(model: nn.Module) -> torch.device:
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype of the first floating parameter or buffer (float32 if none)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def is_oom(e: BaseException) -> bool:
    """Out of device memory: always the caller's to handle, never a reason to step down."""
    return isinstance(e, torch.OutOfMemoryError) if hasattr(torch, "OutOfMemoryError") else "out of memory" in str(e)


def first_line(e: BaseException) -> str:
    """An exception's first line, for reports and warnings (its repr when the message is empty); a
    first line that only introduces the next (dynamo's "backend='inductor' raised:") with that line."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return repr(e)[:300]
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"[:300]
    return lines[0][:300]


def has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


# torch's modules whose forward reads ``training``. Every other torch.nn / torch.ao.nn module computes
# the same in either mode, and some are made in training mode after the user's ``.eval()``: a head
# swapped in for feature extraction (``model.fc = nn.Identity()``), the modules quantize_dynamic puts
# in. Counted as training, they made tk.optimize raise where eager ran (the thirty-third session's probes).
_MODE_DEPENDENT = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._NormBase, nn.RNNBase, nn.RReLU,
                   nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
                   nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                   nn.utils.parametrizations._SpectralNorm)  # its power iteration runs in training mode
_TORCH_MODULES = ("torch.nn.", "torch.ao.nn.")


def acts_in_training(m: nn.Module) -> bool:
    """In training mode, and a module whose training mode may change what it computes: one of torch's
    that reads it, or any other (a user's or a library's forward may read ``self.training``)."""
    return m.training and (isinstance(m, _MODE_DEPENDENT) or not type(m).__module__.startswith(_TORCH_MODULES))


def training_module(model: nn.Module) -> str | None:
    """The name of the first submodule in training mode that it acts on ("" for the root), or None."""
    return next((name for name, m in model.named_modules() if acts_in_training(m)), None)


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Every submodule in eval mode for the block; each one's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in modes:
            m.training = False
        yield model
    finally:
        for m, was in modes:
            m.training = was


PLAIN = (int, float, bool, str, type(None))  # plain attribute values a forward may read (flags, scales)


def plain_attrs(m: nn.Module) -> list[str]:
    """A module's public attributes holding plain values (``training``, ``self.temperature``)."""
    return [k for k, v in vars(m).items() if type(v) in PLAIN and not k.startswith("_")]


def settings(model: nn.Module) -> list:
    """Objects the model's modules hold for their settings: a transformers config, a dataclass of
    hyperparameters; public attributes that are no module, tensor, plain value, container, class or
    callable, once each. Their plain values steer forward as a module's own flags do:
    ``model.config.output_hidden_states = True`` changed eager's outputs, and no copy torchkiln had
    built saw it (each holds its own config; the thirtieth session's probes)."""
    out = {}
    for m in model.modules():
        for k, v in vars(m).items():
            if (not k.startswith("_") and hasattr(v, "__dict__") and not callable(v) and type(v) not in PLAIN
                    and not isinstance(v, (nn.Module, torch.Tensor, type, list, tuple, dict, set))):
                out.setdefault(id(v), v)
    return list(out.values())


def setting_attrs(obj) -> list[str]:
    """A settings object's attributes holding plain values, ``_``-prefixed ones included (transformers
    keeps ``output_attentions`` behind a property, in ``_output_attentions``)."""
    return [k for k, v in vars(obj).items() if type(v) in PLAIN and not k.startswith("__")]


def tensor_attrs(m: nn.Module) -> list[str]:
    """A module's public attributes holding tensors that are not registered parameters or buffers."""
    return [k for k, v in vars(m).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]


def swapped_parameters(model: nn.Module) -> bool:
    """Does a parameter slot hold a tensor that is no ``nn.Parameter``? torch.func.functional_call
    (stateless reparametrization) puts its tensors there for one call; a lasting replacement goes
    through ``nn.Parameter`` (setattr refuses a plain tensor) or ``p.data``."""
    return any(t is not None and not isinstance(t, nn.Parameter) for m in model.modules() for t in m._parameters.values())


def tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def version(t: torch.Tensor) -> int:
    """``t``'s version counter, or -1 for an inference tensor (made under ``torch.inference_mode()``),
    which has none: reading it raises. Such a tensor can only be written in place inside inference
    mode, so its writes are not seen here (tokenizer outputs made under inference_mode crashed every
    call before this)."""
    try:  # not t.is_inference(): an inference parameter given a normal tensor through .data says False and has none
        return t._version
    except RuntimeError:
        return -1


def fingerprint(ts: list[torch.Tensor]) -> tuple:
    """Changes when any tensor is replaced or written in place (version counters)."""
    return tuple((id(t), version(t)) for t in ts)


def keeps_mode(fn):
    """Decorator: the model (first argument) runs in eval mode inside ``fn`` and leaves
    with the train/eval mode of each submodule as the caller had it."""
    import functools

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        if not isinstance(model, nn.Module):
            return fn(model, *args, **kwargs)
        with eval_mode(model):
            return fn(model, *args, **kwargs)
    return wrapper


def inert_hook(hook) -> bool:
    """transformers' own output capture (5.x, ``utils/output_capturing.py``): hooks it installs on a model's
    layers the first time a call asks for hidden states or attentions (segformer's segmentation head
    does at every call), which do nothing unless the running call asked. Left counted, they kept every
    segformer on the model as given (the thirty-sixth session's sweep); compiled forms run them inside
    the graph, and what they collect is the call's output, compared by the guard."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def hooked(model: nn.Module) -> list[str]:
    """Where forward hooks would run: the names of modules with forward (pre-)hooks, and "every
    module (global hooks)" for nn.modules.module's global ones. A traced or transformed copy of
    the model does not call them (a feature-extraction hook fired 0 times in 3 calls of the
    compiled candidate: the new-user sweep, 2026-11-22)."""
    from torch.nn.modules import module as mod

    names = [name or "the model" for name, m in model.named_modules()
             if any(not inert_hook(h) for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))]
    if getattr(mod, "_global_forward_hooks", None) or getattr(mod, "_global_forward_pre_hooks", None):
        names.append("every module (global hooks)")
    return names


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face decoder-only model with a language-model head (it can generate)."""
    config = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    head = getattr(model, "get_output_embeddings", None)
    return (config is not None and not getattr(config, "is_encoder_decoder", False) and callable(can)
            and bool(can()) and callable(head) and isinstance(head(), nn.Linear))


def copy_with(model: nn.Module, fn, plain_only: bool = False) -> nn.Module:
    """``copy.deepcopy(model)`` with each parameter and buffer replaced by ``fn(tensor.detach())``, through
    deepcopy's memo (tied weights stay tied, nothing is copied twice). Where ``fn`` returns its argument, the
    copy shares the original tensor. ``plain_only``: tensor subclasses are left to deepcopy's own way."""
    memo: dict = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) in memo or (plain_only and type(t) not in (torch.Tensor, nn.Parameter)):
            continue
        d = t.detach()
        new = fn(d)
        if new is d:
            memo[id(t)] = t
        elif isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)].__dict__.update(t.__dict__)  # attributes libraries set on a parameter
        else:
            memo[id(t)] = new
    return copy.deepcopy(model, memo)
