"""Layer-wise adaptive optimizers for large-batch training: LAMB (Adam-based) and LARS (SGD-based).

Both are plain `torch.optim.Optimizer`s: they work with lr schedulers, GradScaler, `clip_grad_norm_`
and `state_dict`. Each parameter tensor's step is rescaled by a trust ratio built from ‖w‖, so that
every layer moves by about the same fraction of its weights whatever its gradient scale. The maths
runs on all of a group's tensors at once (`torch._foreach_*`), in fp32 for bf16/fp16 parameters.
"""

from .lamb import Lamb
from .lars import Lars

__all__ = ["Lamb", "Lars"]
