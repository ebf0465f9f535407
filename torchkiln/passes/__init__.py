"""Passes: each a function Module -> Module in its own file, with its own test."""

from .cast_dtype import Fp32Island, cast_dtype
from .channels_last import channels_last, memory_format_for
from .compile import compile_model
from .concat_linear import concat_linear
from .fold_conv_bn import fold_conv_bn
from .fold_linear_bn import fold_linear_bn
from .onednn_linear import OneDNNLinear, onednn_linear
from .quantize import QuantizeConfig
from .replace_dropout import replace_dropout

__all__ = [
    "Fp32Island", "OneDNNLinear", "QuantizeConfig", "cast_dtype", "channels_last", "compile_model", "concat_linear",
    "fold_conv_bn", "fold_linear_bn", "memory_format_for", "onednn_linear", "replace_dropout",
]
