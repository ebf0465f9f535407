"""Fake machines and tiny models for planner tests: no detection, no measurement."""

from __future__ import annotations

import torch
from torch import nn

from torchkiln.hardware import AcceleratorInfo, CPUInfo, Hardware, SoftwareInfo

SOFTWARE = SoftwareInfo(python="3.11", torch="2.13.0", torchao=None, transformers=None,
                        backends={"onednn": True, "mkl": True})


def cpu_info(arch: str = "x86_64", vendor: str = "GenuineIntel", features: tuple[str, ...] = ("avx2", "fma")):
    return CPUInfo(arch=arch, vendor=vendor, model="fake", physical_cores=8, logical_cores=16, sockets=1,
                   numa_nodes=1, memory_bytes=64 << 30, features=features)


def machine(cpu: CPUInfo | None = None, *accelerators: AcceleratorInfo) -> Hardware:
    return Hardware(platform="linux-x86_64", cpu=cpu or cpu_info(), accelerators=tuple(accelerators),
                    software=SOFTWARE)


X86_BF16 = machine(cpu_info(features=("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni")))
X86_NO_BF16 = machine(cpu_info(vendor="AuthenticAMD", features=("avx2", "fma")))
ARM_BF16 = machine(cpu_info(arch="aarch64", vendor="ARM", features=("neon", "asimd", "bf16", "i8mm")))
H100 = machine(X86_NO_BF16.cpu, AcceleratorInfo(type="cuda", index=0, name="NVIDIA H100", capability="9.0",
                                                bf16=True, fp16=True, fp8=True, usable=True))
V100 = machine(X86_NO_BF16.cpu, AcceleratorInfo(type="cuda", index=0, name="Tesla V100", capability="7.0",
                                                bf16=False, fp16=True, fp8=False, usable=True))
XPU = machine(X86_BF16.cpu, AcceleratorInfo(type="xpu", index=0, name="Intel Arc", bf16=True, fp16=True,
                                            usable=True))
MPS = machine(cpu_info(arch="arm64", vendor="Apple", features=("neon", "bf16")),
              AcceleratorInfo(type="mps", index=0, name="Apple M2", bf16=True, fp16=True, usable=True))

# (id, hardware, device) for every device family; ids never equal "cuda" (conftest skips that keyword).
CPUS = [("x86-bf16", X86_BF16, "cpu"), ("x86-nobf16", X86_NO_BF16, "cpu"), ("arm-bf16", ARM_BF16, "cpu")]
GPUS = [("sm90", H100, "cuda:0"), ("sm70", V100, "cuda:0")]
GENERIC = [("xpu", XPU, "xpu:0"), ("mps", MPS, "mps:0")]
MACHINES = CPUS + GPUS + GENERIC
LEVELS = ("O0", "O1", "O2")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64),
                         nn.LayerNorm(64)).eval()


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10)).eval()


def bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     vocab_size=100)
    return BertModel(cfg).eval()


BF16 = torch.bfloat16
FP32 = torch.float32
