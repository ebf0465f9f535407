"""The float oneDNN conv net (passes/onednn_conv_net.py) against the oneDNN Graph trace, and where its
time goes per 3x3 convolution, direct against Winograd.

    python benchmarks/diag_conv_net.py --model resnet50 --batch 1 --dtypes float32,bfloat16
    python benchmarks/diag_conv_net.py --model resnet18      # or vgg11: defined here, torchvision's layout

Part 1, one process, interleaved rounds (each round times every peer for --iters calls, in turn):
the oneDNN Graph trace of the BatchNorm-folded model (what optimize() served before; bf16: of the
model cast to bf16), the conv net with oneDNN's direct kernels only, and with each 3x3 stride-1
convolution in its fastest form. Medians of the per-round medians, and the paired ratio.
Part 2: each eligible convolution's least time inside whole runs of the net (Net.times), direct
against the form the Winograd net chose.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.fx.experimental.optimization as fx_opt
from torch import nn

from torchkiln import zoo
from torchkiln.passes.onednn_conv_net import OneDNNConvNet
from torchkiln.passes.onednn_graph import OneDNNGraph


class _Basic(nn.Module):
    """torchvision's BasicBlock: two 3x3 convolutions, the residual added before the last ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.down is None else self.down(x)
        return self.relu(out)


def resnet18() -> nn.Module:
    layers, cin = [], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Basic(cin, cout, stride), _Basic(cout, cout, 1)]
        cin = cout
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


def vgg11() -> nn.Module:
    """torchvision's VGG-11 (no BatchNorm): eight 3x3 convolutions, then a 7x7 pool and a 3-layer head."""
    layers, cin = [], 3
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
            cin = v
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(), nn.Linear(512 * 49, 4096), nn.ReLU(True),
                         nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 1000))


LOCAL = {"resnet18": resnet18, "vgg11": vgg11}


def load(name: str, batch: int):
    if name not in LOCAL:
        return zoo.load(name, batch)[:2]
    torch.manual_seed(0)
    model = LOCAL[name]().eval()
    g = torch.Generator().manual_seed(0)
    for m in model.modules():  # running statistics a trained model has
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model, torch.randn(batch, 3, 224, 224)


def timed(fn, x, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t) / iters * 1e3


def per_layer(direct: OneDNNConvNet, wino: OneDNNConvNet, calls: int = 10):
    (nd,), (nw,) = direct.rewritten.conv_net.nets.values(), wino.rewritten.conv_net.nets.values()
    td, tw, forms, dims = nd.times(calls), nw.times(calls), nw.forms(), nd.dims
    print("| step | conv (C -> K, H x W) | direct us | chosen | chosen us |")
    print("|---|---|---|---|---|")
    for i, s in enumerate(nd.steps, 1):
        if forms[i] >= 0:  # a convolution that could take Winograd
            c, (k, h, w) = dims[s.src][1], dims[i][1:]
            name = {4: "F(4x4, 3x3)", 2: "F(2x2, 3x3)", 0: "direct"}[forms[i]]
            print(f"| {i} | {c} -> {k}, {h} x {w} | {td[i] * 1e6:.0f} | {name} | {tw[i] * 1e6:.0f} |")
    print(f"whole net (sum of least per-op times): direct {sum(td) * 1e3:.2f} ms, chosen {sum(tw) * 1e3:.2f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    model, x = load(a.model, a.batch)
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        folded = fx_opt.fuse(copy.deepcopy(model)).to(dtype)
        graph = OneDNNGraph(folded)
        direct = OneDNNConvNet(model, winograd=False, dtype=dtype)
        wino = OneDNNConvNet(model, winograd=True, dtype=dtype)
        peers = {"oneDNN Graph trace": lambda t, g=graph, d=dtype: g(t.to(d)), "conv net, direct": direct,
                 "conv net, Winograd": wino}
        times = {k: [] for k in peers}
        with torch.no_grad():
            ref = model(x)
            for k, f in peers.items():
                out = f(x).float()
                print(f"{a.model} bs{a.batch} {name} {k}: error vs eager float32 "
                      f"{float((out - ref).norm() / ref.norm()):.2e}")
                for _ in range(3):
                    f(x)
            for r in range(a.rounds):
                order = list(peers.items())
                order = order[r % len(order):] + order[:r % len(order)]
                for k, f in order:
                    times[k].append(timed(f, x, a.iters))
        base = times["oneDNN Graph trace"]
        print(f"\n| {a.model} bs{a.batch} {name} | median ms | vs oneDNN Graph trace (paired) |")
        print("|---|---|---|")
        for k, v in times.items():
            ratio = statistics.median(b / t for b, t in zip(base, v, strict=True))
            print(f"| {k} | {statistics.median(v):.2f} | {ratio:.2f}x |")
        print(f"Winograd net: {wino.describe()}\n")
        per_layer(direct, wino)
        print()


if __name__ == "__main__":
    main()
