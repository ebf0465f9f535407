import pytest

from torchkiln.plan import cpu as cpu_plan

RATES = {"onednn": {"aten": 200.0, "onednn": 500.0}, "aten": {"aten": 500.0, "onednn": 200.0}}


class FakeGemm:
    """Stands in for cpu.gemm_choice: a fixed answer, and a record of what was asked."""

    def __init__(self, answer: str = "aten"):
        self.answer = answer
        self.calls: list[tuple] = []

    def __call__(self, dtype, m, k, n):
        self.calls.append((dtype, m, k, n))
        return self.answer, dict(RATES[self.answer])


@pytest.fixture(autouse=True)
def gemm(monkeypatch):
    """Every planner test gets a fake GEMM measurement (default: aten wins); set .answer to change it."""
    fake = FakeGemm()
    monkeypatch.setattr(cpu_plan, "gemm_choice", fake)
    return fake
