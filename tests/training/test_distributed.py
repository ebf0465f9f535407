"""DDP and FSDP2 with 2 CPU processes (gloo): torchkiln's training pair, wrapped before or
after tk.optimize (FSDP2: fully_shard first), matches one process on the whole batch."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchkiln as tk

STEPS, BATCH = 4, 16


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10)).train()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _worker(rank, world, init, order, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = net()
        if order == "fsdp2-first":
            from torch.distributed.fsdp import fully_shard

            for layer in (model[0], model[3]):
                fully_shard(layer)
            fully_shard(model)
            fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    time_budget=0)
        elif order == "ddp-first":
            ddp = DDP(model)
            fast, opt = tk.optimize(ddp, optimizer=torch.optim.AdamW(ddp.parameters(), lr=1e-2), time_budget=0)
        elif order == "ranks-disagree":
            # Rank 1's guard rejects the compiled step and rank 0's passes; the budget would let each
            # rank's clock decide how many steps it times. Every rank must still serve the same step.
            from torchkiln.training.module import TrainModule

            if rank == 1:  # it still runs the probe steps: they are collectives the other rank joins
                verify = TrainModule._verify
                TrainModule._verify = lambda self, a, k, r: (verify(self, a, k, r),
                                                             {n: (False, "injected on rank 1", None) for n in r})[1]
            ddp = DDP(model)
            fast, opt = tk.optimize(ddp, optimizer=torch.optim.AdamW(ddp.parameters(), lr=1e-2),
                                    time_budget=0.5)
        else:
            fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    time_budget=0)
            fast = DDP(fast)
        for s in range(STEPS):
            x, y = batch(s)
            half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            opt.zero_grad()
            nn.functional.cross_entropy(fast(x[half]), y[half]).backward()
            opt.step()
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # FSDP2 shards
        if rank == 0:
            torch.save([p.detach() for p in full], out)
        torch.save({"active": fast.kiln_report.active if hasattr(fast, "kiln_report") else None,
                    "applied": list(fast.kiln_report.applied) if hasattr(fast, "kiln_report") else [],
                    # type(), not isinstance: torchkiln's model over a DDP shows DDP's class to isinstance
                    "one_graph": type(getattr(fast.module if type(fast) is DDP else fast, "_compiled", None)).__name__
                    == "OneGraph",
                    "fallbacks": [f.reason for f in getattr(fast, "kiln_report", None).fallbacks]
                    if hasattr(fast, "kiln_report") else []}, f"{out}.{rank}")
        dist.barrier()  # no rank tears down while another still talks (an FSDP2 run aborted once there)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes, each compiling: about 50 s on 2 cores
@pytest.mark.parametrize("order", ["ddp-first", "ddp-after", "fsdp2-first", "ranks-disagree"])
def test_ddp_two_processes_match_one(order):
    ref = net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()  # the mean over the whole batch
        opt.step()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "params.pt")
        mp.spawn(_worker, args=(2, f"file://{d}/store", order, out), nprocs=2, join=True)
        got = torch.load(out)
        reports = [torch.load(f"{out}.{r}") for r in (0, 1)]
    if order == "ranks-disagree":
        assert reports[0]["active"] == reports[1]["active"] and reports[0]["active"].startswith("eager"), reports
        assert any("another rank" in f for f in reports[0]["fallbacks"]), reports[0]
        assert any("injected on rank 1" in f for f in reports[1]["fallbacks"]), reports[1]
    if order in ("ddp-first", "ddp-after"):  # DDP inside torchkiln's model: its compiled step is one graph
        assert all(rep["one_graph"] == (order == "ddp-first") for rep in reports), reports
    if order == "ddp-first":  # and the report says so where it serves
        for rep in reports:
            assert not rep["active"].startswith("compiled") or any("one graph under DDP" in a for a in rep["applied"]), rep
    for p, q in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(p, q.detach(), rtol=1e-4, atol=1e-5)


def test_one_graph_compiles_with_optimize_ddp_off_and_restores_it():
    import torch._dynamo

    from torchkiln.training.module import OneGraph, _under_ddp

    before = torch._dynamo.config.optimize_ddp
    seen = []
    out = OneGraph(lambda x: seen.append(torch._dynamo.config.optimize_ddp) or x + 1)(torch.ones(1))
    assert seen == [False] and torch._dynamo.config.optimize_ddp == before and float(out) == 2.0
    assert not _under_ddp(net())
