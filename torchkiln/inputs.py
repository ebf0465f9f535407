"""One convention for sample inputs everywhere in torchkiln: a tensor, a tuple
of positional arguments, or a dict of keyword arguments."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.utils._pytree as pytree

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


def tree_map(fn, obj):
    """Apply ``fn`` to every tensor in nested containers. torch's pytree is used
    because dynamo traces it without graph breaks and transformers registers its
    ModelOutput classes with it."""
    return pytree.tree_map_only(torch.Tensor, fn, obj)


def flatten(obj) -> list[torch.Tensor]:
    """Every tensor in an output, in a stable order (for numeric comparison)."""
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def to(args: Args, device=None, dtype=None) -> Args:
    """Move inputs; cast only floating tensors (token ids stay integers)."""

    def move(t: torch.Tensor):
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    a, k = args
    return tree_map(move, a), tree_map(move, k)


def batch_size(args: Args) -> int | None:
    ts = flatten(args)
    return int(ts[0].shape[0]) if ts and ts[0].dim() > 0 else None
