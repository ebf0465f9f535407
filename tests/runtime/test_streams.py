"""tk.runtime: CPUPool, pin, MultiStreamModule, Task. Pinning is read back from the threads
that ran, not assumed."""

import os

import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln.runtime import CPUPool, MultiStreamModule, Task, pin

CPUS = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 usable CPUs")


class Where(nn.Module):
    """Returns, per row, the CPUs and thread count of the thread that ran it, plus a real output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        seen = torch.tensor([[sum(1 << c for c in os.sched_getaffinity(0)), torch.get_num_threads()]] * len(x))
        return self.lin(x), seen


def test_cpupool_and_its_errors():
    assert set(CPUPool().core_ids) <= set(CPUS) and CPUPool().core_ids
    assert CPUPool([CPUS[0]]).core_ids == (CPUS[0],)
    with pytest.raises(ValueError, match="core_ids="):
        CPUPool([10_000])
    with pytest.raises(ValueError, match="node_id=99"):
        CPUPool(node_id=99)
    with pytest.raises(ValueError, match="cannot split"):
        CPUPool([CPUS[0]]).split(2)


def test_pin_binds_the_thread_and_restores_it():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with pin(CPUPool([CPUS[0]])):
        assert os.sched_getaffinity(0) == {CPUS[0]} and torch.get_num_threads() == 1
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads


@two_cores
def test_streams_run_on_their_own_cores_and_match_one_stream():
    torch.manual_seed(0)
    model = Where().eval()
    x = torch.randn(10, 16)
    ms = MultiStreamModule(model, num_streams=2, pool=CPUPool(CPUS[:2]))
    with torch.no_grad():
        out, seen = ms(x)
        ref, _ = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    masks = seen[:, 0].tolist()
    assert masks[:5] == [1 << CPUS[0]] * 5 and masks[5:] == [1 << CPUS[1]] * 5  # each half on its own core
    assert seen[:, 1].tolist() == [1] * 10  # one OpenMP thread per one-core stream
    assert torch.get_num_threads() >= 1 and os.sched_getaffinity(0) == set(CPUS)  # the caller untouched


@two_cores
def test_an_optimized_model_runs_inside_multistream():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).eval()
    x = torch.randn(8, 32)
    fast = tk.optimize(model, sample_input=x[:4], time_budget=0)
    ms = MultiStreamModule(fast, num_streams=2, pool=CPUPool(CPUS[:2]))
    with torch.no_grad():
        torch.testing.assert_close(ms(x), model(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ms(x * 2), model(x * 2), rtol=1e-5, atol=1e-5)


def test_task_returns_a_future_run_on_its_pool():
    model = Where().eval()
    task = Task(model, CPUPool([CPUS[-1]]))
    x = torch.randn(3, 16)
    fut = task(x)
    with torch.no_grad():
        out, seen = fut.get()
    torch.testing.assert_close(out, model(x)[0])
    assert seen[:, 0].tolist() == [1 << CPUS[-1]] * 3


def test_multistream_bad_input():
    with pytest.raises(ValueError, match="num_streams=99"):
        MultiStreamModule(nn.Linear(2, 2), num_streams=99)
    with pytest.raises(ValueError, match="batch dimension"):
        MultiStreamModule(nn.Identity(), num_streams=1)(3)
