"""What the tests measure memory with."""

import gc

import torch
from torch import nn


def live_tensor_bytes() -> int:
    """Bytes of every distinct CPU tensor storage the garbage collector can reach."""
    for _ in range(3):  # dropping a compiled wrapper frees more on the next pass (its finalizers run)
        gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        if type(o) not in (torch.Tensor, nn.Parameter):
            continue
        try:  # opaque tensors (mkldnn; on torch 2.6 one without a device) have neither
            if o.device.type != "cpu":
                continue
            s = o.untyped_storage()
        except (NotImplementedError, RuntimeError):
            continue
        if s.data_ptr() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
