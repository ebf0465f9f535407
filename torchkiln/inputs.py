"""One convention for sample inputs everywhere in torchkiln: a tensor, a tuple
of positional arguments, or a dict of keyword arguments."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.utils._pytree as pytree

from .modelutil import PLAIN

Args = tuple[tuple, dict]


def normalize(sample) -> Args:
    if sample is None:
        raise ValueError("sample_input is None; pass a tensor, a tuple of positional args, or a dict of kwargs")
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    raise TypeError(
        f"sample_input must be a tensor, a tuple of positional args or a dict of keyword args, "
        f"got {type(sample).__name__}"
    )


def _arg_signature(v):
    if isinstance(v, torch.Tensor):
        return (v.shape, v.dtype)
    return (type(v).__name__, v) if type(v) in PLAIN else type(v).__name__


def signature(args, kwargs) -> tuple:
    """A call's form: each tensor's shape and dtype, plain values by value (output_hidden_states=True
    is another call form than False), other objects by type. Computed at many calls: the one-tensor
    call skips the generic walk (2.2 of the returned model's 6 us a call on an 8x8 Linear, 2-core
    Zen 4, thirty-sixth session; torch.Size hashes and compares as the tuple it is)."""
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
        return ((args[0].shape, args[0].dtype),)
    if kwargs:
        return tuple([_arg_signature(a) for a in args]) + tuple([(k, _arg_signature(v)) for k, v in kwargs.items()])
    return tuple([_arg_signature(a) for a in args])


def describe(args, kwargs) -> str:
    """A call form as a person reads it (the one ``signature`` keys on): tensors by shape, plain values
    by value, other objects by type: ``[3, 43], attention_mask [3, 43], return_dict=True``."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return str(list(v.shape))
        return repr(v) if type(v) in PLAIN else f"<{type(v).__name__}>"
    parts = [one(a) for a in args]
    parts += [f"{k} {one(v)}" if isinstance(v, torch.Tensor) else f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) or "no arguments"


def tree_map(fn, obj):
    """Apply ``fn`` to every tensor in nested containers. torch's pytree is used
    because dynamo traces it without graph breaks and transformers registers its
    ModelOutput classes with it."""
    return pytree.tree_map_only(torch.Tensor, fn, obj)


def detach(obj):
    """``tree_map(Tensor.detach, obj)`` that keeps aliasing: a tensor passed twice (transformers'
    ``labels=input_ids``) stays one tensor. dynamo guards on it ("Duplicate tensors found"), so with
    the two detached apart, the training setup compiled its step for two tensors and the loop's first
    call compiled it a third time (a tiny BERT under TORCH_LOGS=recompiles, fifty-first session)."""
    memo: dict[int, torch.Tensor] = {}

    def one(t):
        d = memo.get(id(t))
        if d is None:
            d = memo[id(t)] = t.detach()
        return d
    return tree_map(one, obj)


def clone(obj):
    """``tree_map(torch.clone, obj)`` for a model's outputs (``map_tensors`` says why not pytree)."""
    return map_tensors(torch.clone, obj)


def map_tensors(fn, obj):
    """``tree_map(fn, obj)`` for a model's outputs, without pytree's generic walk on the containers
    models return: a CUDA-graph output is copied out of its pool on every call, and pytree took 71 us
    per call for a transformers ModelOutput of two tensors where the clones took 10 (2-core Zen 3;
    the H200 served path lost 70-140 us per call to such costs, benchmarks/RESULTS.md, fourteenth
    session). Other containers take pytree's path; a dataclass (pytree's leaf) is walked by field."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    kind = type(obj)
    if kind is tuple or kind is list:
        return kind(map_tensors(fn, v) for v in obj)
    if kind is dict:
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, OrderedDict) and hasattr(kind, "to_tuple"):  # a transformers ModelOutput
        return _map_model_output(fn, obj)
    if _is_dataclass(obj):  # pytree's leaf: its tensors would have been left as they were
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(fn, getattr(obj, f.name)))
        return new
    return tree_map(fn, obj)


def _is_dataclass(obj) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _map_model_output(fn, obj):
    # A ModelOutput keeps each field twice, as an attribute and (when not None) as an item; its
    # constructor re-derives both (24 us on the Zen 3 above); set directly, the copy took 18 us, clones included.
    kind = type(obj)
    if not all(k in obj.__dict__ for k in obj):  # not the layout this relies on: the constructor
        return kind(**{k: map_tensors(fn, v) for k, v in obj.items()})
    new = kind.__new__(kind)
    new.__dict__.update(obj.__dict__)
    for k, v in obj.items():
        c = map_tensors(fn, v)
        OrderedDict.__setitem__(new, k, c)
        object.__setattr__(new, k, c)
    return new


def shapes(args, kwargs) -> list[tuple[int, ...]]:
    """The shapes of a call's tensors, in ``flatten``'s order (for reports and messages)."""
    return [tuple(t.shape) for t in flatten((args, kwargs))]


def flatten(obj) -> list[torch.Tensor]:
    """Every tensor in an output, in a stable order (for numeric comparison). A dataclass that is no
    pytree node (a model's own output class) is walked field by field: as a leaf it gave the guard no
    tensor to compare, so every candidate passed unverified (the twenty-ninth session's probes)."""
    out = []
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif _is_dataclass(leaf):
            out += flatten([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return out


def need_grad(args, kwargs) -> bool:
    """Does any input tensor require grad? Runs on calls made with grad mode on, so top-level
    tensors are read directly and only containers take pytree's walk."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, (list, tuple, dict)) and any(t.requires_grad for t in flatten(v)):
            return True
    return False


def to(args: Args, device=None, dtype=None) -> Args:
    """Move inputs; cast only floating tensors (token ids stay integers)."""
    a, k = args
    if dtype is None and device is not None:
        # Inputs already there (the usual case) skip the pytree walk: ~50 us a call, paid by every call
        # the original answers through candidates.OnDevice (an MLP at one row on a 2-core Zen 4: 385
        # against the model's own 336 us; RESULTS.md, thirty-third session).
        dev = torch.device(device)
        if all(v.device == dev if isinstance(v, torch.Tensor) else type(v) in PLAIN for v in (*a, *k.values())):
            return tuple(a), dict(k)

    def move(t: torch.Tensor):
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    return tree_map(move, a), tree_map(move, k)


def out_of_inference(obj):
    """``obj`` with each inference tensor (made under ``torch.inference_mode()``) cloned out of it."""
    return map_tensors(lambda t: t.clone() if t.is_inference() else t, obj)


def rows(args: Args) -> int | None:
    """Rows a model's linear layers see per call (the M of their GEMMs), estimated from its first input:
    token ids (batch x sequence) and float sequences (batch x sequence x features) give batch x
    sequence, other inputs their batch. A text model's batch alone undercounted them 64-fold (seq 64),
    and the GEMM path measured at that M was the slower one at the real M (plan/cpu.py)."""
    ts = flatten(args)
    if not ts or ts[0].dim() == 0:
        return None
    t = ts[0]
    if (t.dim() >= 2 and not t.is_floating_point()) or (t.dim() == 3 and t.is_floating_point()):
        return int(t.shape[0] * t.shape[1])
    return int(t.shape[0])


def batch_size(args: Args) -> int | None:
    ts = flatten(args)
    return int(ts[0].shape[0]) if ts and ts[0].dim() > 0 else None
