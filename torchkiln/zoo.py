"""Built-in models for bench and demo: random-initialised, no downloads.

Transformer models come from transformers configs (the optional extra). ResNet-50
is written out here because torchvision is not a dependency; it uses
torchvision's module names, so torchvision checkpoints load into it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch
from torch import nn


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._layer(64, layers[0], 1)
        self.layer2 = self._layer(128, layers[1], 2)
        self.layer3 = self._layer(256, layers[2], 2)
        self.layer4 = self._layer(512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # Non-trivial running statistics, as a trained model has: folding must use them.
        g = torch.Generator().manual_seed(0)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        down = None
        if stride != 1 or self.inplanes != planes * 4:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False),
                                 nn.BatchNorm2d(planes * 4))
        layers = [_Bottleneck(self.inplanes, planes, stride, down)]
        self.inplanes = planes * 4
        layers += [_Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError("this zoo model needs transformers: pip install 'torchkiln[transformers]'") from e


def _hf(config_name: str, model_name: str, attention: bool = True, **cfg):
    tf = _transformers()
    config = getattr(tf, config_name)(**({"attn_implementation": "sdpa"} if attention else {}), **cfg)
    return getattr(tf, model_name)(config).eval()


def resnet50(batch: int = 1, seq: int = 128):
    return ResNet().eval(), torch.randn(batch, 3, 224, 224)


def _bn_calibrated(model: nn.Module) -> nn.Module:
    """``model`` with its BatchNorm statistics measured on random images, as training leaves them.
    Random-init transformers CNNs keep mean 0 / variance 1, and in eval their activations shrink
    layer by layer (MobileNetV2's logits ~1e-22): timings would be of no real model, and an int8
    quantization of them is noise (0 dB)."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # a plain average over the batches
        if m.affine:  # EfficientNet's init draws them from N(0, 0.02): each layer then shrinks 50x
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(8, 3, 224, 224))
    return model.eval()


def resnet50_hf(batch: int = 1, seq: int = 128):
    """transformers' ResNet-50 for classification (a torchvision-free ResNet as HF users load it)."""
    model = _hf("ResNetConfig", "ResNetForImageClassification", attention=False, num_labels=1000)
    return _bn_calibrated(model), torch.randn(batch, 3, 224, 224)


def mobilenet_v2(batch: int = 1, seq: int = 128):
    """transformers' MobileNetV2 for classification: depthwise convolutions, ReLU6, TF "same" padding."""
    model = _hf("MobileNetV2Config", "MobileNetV2ForImageClassification", attention=False, num_labels=1000)
    return _bn_calibrated(model), torch.randn(batch, 3, 224, 224)


def efficientnet_b0(batch: int = 1, seq: int = 128):
    """transformers' EfficientNet-B0 for classification: SiLU, squeeze-and-excite gates, "same" padding."""
    model = _hf("EfficientNetConfig", "EfficientNetForImageClassification", attention=False, num_labels=1000,
                width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280)
    return _bn_calibrated(model), torch.randn(batch, 3, 224, 224)


def bert_base(batch: int = 1, seq: int = 128):
    model = _hf("BertConfig", "BertModel")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def vit_base(batch: int = 1, seq: int = 128):
    return _hf("ViTConfig", "ViTModel"), torch.randn(batch, 3, 224, 224)


def gpt2(batch: int = 1, seq: int = 128):
    model = _hf("GPT2Config", "GPT2Model")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}


def llama_small(batch: int = 1, seq: int = 128):
    model = _hf("LlamaConfig", "LlamaModel", hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)
    ids = torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "use_cache": False}


def mlp(batch: int = 8, seq: int = 128):
    """A small classifier head: fast enough for demos and tests on two cores."""
    model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(1024, 1024), nn.LayerNorm(1024), nn.GELU(), nn.Linear(1024, 10)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model, torch.randn(batch, 256)


MODELS: dict[str, Callable] = {
    "resnet50": resnet50,
    "resnet50-hf": resnet50_hf,
    "mobilenet-v2": mobilenet_v2,
    "efficientnet-b0": efficientnet_b0,
    "bert-base": bert_base,
    "vit-base": vit_base,
    "gpt2": gpt2,
    "llama-small": llama_small,
    "mlp": mlp,
}


def check_name(name: str) -> None:
    """A zoo name or a ``module:callable`` form (not imported here), else a clear error."""
    if name not in MODELS and ":" not in name:
        raise ValueError(f"unknown model {name!r}; use one of {sorted(MODELS)} or 'package.module:callable'")


def load(name: str, batch: int = 1, seq: int = 128, shape: tuple[int, ...] | None = None):
    """A zoo name or ``module:callable`` -> (model, sample_input).

    The callable may return a model or ``(model, sample_input)``; with a bare
    model, ``shape`` gives a random float input.
    """
    if name in MODELS:
        torch.manual_seed(0)
        return MODELS[name](batch=batch, seq=seq)
    check_name(name)
    mod_name, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {name!r}: {e}") from e
    needs = _required_args(obj)
    if needs:
        raise ValueError(f"{name!r} needs argument(s) {', '.join(needs)}; point at a callable that takes none and "
                         "returns a model or (model, sample_input), e.g. a small function in your own module")
    built = obj()
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        return built[0].eval(), built[1]
    if not isinstance(built, nn.Module):
        raise ValueError(f"{name!r} returned {type(built).__name__}; expected an nn.Module or (model, sample_input)")
    if shape is None:
        raise ValueError(f"{name!r} returned a bare model; pass --shape (e.g. --shape 1,3,224,224) for its input")
    return built.eval(), torch.randn(*shape)


def _required_args(obj) -> list[str]:
    """Parameters ``obj()`` would be missing (none where the signature cannot be read)."""
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
