"""The training step under CUDA graphs (training/graphs.py) on a GPU, against eager autocast.

A tiny GPT-2 (dropout 0, so eager and compiled draw no random numbers) in a loop with the habits
graph trees break: two micro-batches per step (a second backward before zero_grad), one step with
zero_grad(set_to_none=False), losses kept with .detach() past the next step, gradient clipping, an
eval call in the middle. The references are a copy trained eagerly under stock autocast.
"""

import copy

import pytest
import torch

import torchkiln as tk
from torchkiln.training.module import TrainModule

pytestmark = pytest.mark.cuda


def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).cuda().train()


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def graphs_served(monkeypatch):
    timed = TrainModule._time

    def pick(self, fns, by, args, kwargs):
        timed(self, fns, by, args, kwargs)
        assert "graphs" in fns, [(m.name, m.status, m.reason) for m in self.kiln_report.candidates]
        return "graphs"

    monkeypatch.setattr(TrainModule, "_time", pick)


def test_a_graph_served_loop_accumulates_keeps_losses_and_matches_eager(graphs_served):
    model = gpt2()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    batches = [torch.randint(0, 128, (4, 32), device="cuda") for _ in range(6)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    fast, opt = tk.optimize(model, optimizer=opt, dtype=torch.bfloat16,
                            sample_input={"input_ids": batches[0], "labels": batches[0]}, time_budget=0.2,
                            level="O2")
    assert fast.kiln_recipe.graphs and "under CUDA graphs" in fast.kiln_report.active, fast.kiln_report
    assert fast.kiln_report.guard["ok"]
    runs = {}
    for name, m, o, autocast in (("fast", fast, opt, False), ("ref", ref, ref_opt, True)):
        losses, first_grads = [], None
        for step in range(3):
            o.zero_grad(set_to_none=step != 1)
            for b in batches[2 * step: 2 * step + 2]:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = m(input_ids=b, labels=b).loss / 2
                loss.backward()
                losses.append(loss.detach())  # kept past the next replay
            if step == 0:
                first_grads = [p.grad.clone() for p in m.parameters()]
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
        runs[name] = (torch.stack(losses), first_grads)
    # bf16 rounding apart, the same numbers; a pooled .grad overwritten by the second micro-batch is off by
    # the first micro-batch's whole share (rel ~1), kept losses rewritten by later replays equal each other
    losses, grads = runs["fast"]
    ref_losses, ref_grads = runs["ref"]
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=2e-3)
    assert max(rel(g, r) for g, r in zip(grads, ref_grads, strict=True)) < 0.05
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert rel(p, q) < 1e-2
    fast.eval()
    ref.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = ref(input_ids=batches[0]).logits
    with torch.no_grad():
        got = fast(input_ids=batches[0]).logits
    assert rel(got, want) < 2e-2
    fast.train()
    fast(input_ids=batches[1], labels=batches[1]).loss.backward()  # training again after the eval call
    assert all(p.grad is not None for p in model.parameters())


def test_the_graphs_candidate_is_verified_and_timed_beside_the_compiled_step():
    model = gpt2()
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (4, 32), device="cuda")
    fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                            dtype=torch.bfloat16, sample_input={"input_ids": ids, "labels": ids}, time_budget=0.3,
                            level="O2")
    by = {m.name.split(" (")[0]: m for m in fast.kiln_report.candidates}
    assert set(by) == {"eager", "compiled forward+backward", "compiled forward+backward under CUDA graphs"}
    graphs = by["compiled forward+backward under CUDA graphs"]
    assert graphs.status in ("served", "passed") and graphs.median_ms > 0, fast.kiln_report
    served = [m for m in fast.kiln_report.candidates if m.status == "served"]
    assert len(served) == 1 and served[0].median_ms == min(m.median_ms for m in by.values())
    for _ in range(3):  # the served step trains (whichever it is)
        opt.zero_grad()
        fast(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def test_a_failing_graph_replay_steps_down_to_the_compiled_step(graphs_served):
    model = gpt2()
    ids = torch.randint(0, 128, (4, 32), device="cuda")
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                          sample_input={"input_ids": ids, "labels": ids}, time_budget=0.1, level="O2")
    fast._graphs.fn = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("replay broke"))
    with pytest.warns(UserWarning, match="stepping down to compiled forward"):
        loss = fast(input_ids=ids, labels=ids).loss
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = model(input_ids=ids, labels=ids).loss
    assert abs(float(loss) - float(want)) < 2e-2 * abs(float(want))
    assert fast.kiln_report.active.startswith("compiled forward+backward (")
    assert "replay broke" in fast.kiln_report.fallbacks[-1].reason
