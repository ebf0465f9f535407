"""The training pair inside transformers' own loop: Trainer with its defaults, accelerate's autocast wrapper,
save_pretrained. Each case failed for a new-user probe (fifty-first session)."""

import copy
import inspect

import pytest
import torch

import torchkiln as tk

from .test_training import with_bf16

transformers = pytest.importorskip("transformers")


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100, num_labels=2, attn_implementation="sdpa",
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # compiled dropout draws
    # other masks than eager's (tests/passes/test_hash_dropout.py checks those): no trajectory would agree
    return transformers.BertForSequenceClassification(cfg).train()


class Rows(torch.utils.data.Dataset):
    """What a tokenized datasets.Dataset yields, with a column the model does not take (Trainer drops it by
    reading forward's parameters)."""

    def __init__(self, n=32):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 100, (n, 12), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long),
                "labels": self.labels[i], "text": "a raw string column"}


def run_trainer(model, opt, tmp_path, bf16):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4,
                                          learning_rate=1e-3, use_cpu=True, bf16=bf16, report_to=[],
                                          save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), optimizers=(opt, sched))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


@pytest.mark.parametrize("bf16", [False, True])
def test_trainer_with_its_defaults_trains_the_pair_as_it_trains_the_model(tmp_path, monkeypatch, bf16):
    # Trainer keeps the dataset columns forward's signature names (the pair showed (*args, **kwargs): every
    # input dropped, "You must specify exactly one of input_ids or inputs_embeds"), and with bf16=True wraps
    # the forward in autocast (RecursionError inside the pair's autocast handling).
    pytest.importorskip("accelerate")
    if bf16:
        with_bf16(monkeypatch)
    model = tiny_bert()
    ref = copy.deepcopy(model)
    fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                            dtype=torch.bfloat16 if bf16 else None, time_budget=0)
    assert list(inspect.signature(fast.forward).parameters) == list(inspect.signature(ref.forward).parameters)
    got, trainer = run_trainer(fast, opt, tmp_path / "tk", bf16)
    want, _ = run_trainer(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), tmp_path / "ref", bf16)
    assert len(got) == len(want) == 4
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2 if bf16 else 1e-4, atol=0)
    trainer.save_model(str(tmp_path / "saved"))
    loaded = type(ref).from_pretrained(str(tmp_path / "saved"))
    for k, v in fast.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)


def test_a_forward_wrapped_in_autocast_is_served_once_not_recursively(monkeypatch):
    # accelerate's prepare(model) with mixed_precision="bf16" does this to the model it is given
    with_bf16(monkeypatch)
    model = tiny_bert()
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(2))
    fast, _ = tk.optimize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                          time_budget=0)
    fast.forward = torch.autocast("cpu", dtype=torch.bfloat16)(fast.forward)
    loss = fast(input_ids=ids, labels=torch.tensor([0, 1, 0, 1])).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(input_ids=ids, labels=torch.tensor([0, 1, 0, 1])).loss
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=0)
    served = tk.optimize(tiny_bert().eval(), dtype=torch.bfloat16, sample_input={"input_ids": ids}, time_budget=0)
    served.forward = torch.autocast("cpu", dtype=torch.bfloat16)(served.forward)  # the inference model too
    assert served(input_ids=ids).logits.shape == (4, 2)


def test_save_pretrained_with_split_weights_writes_the_float32_masters(tmp_path, monkeypatch):
    with_bf16(monkeypatch)
    model = tiny_bert()
    fast, opt = tk.optimize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=torch.bfloat16,
                            split_master_weight_for_bf16=True, time_budget=0)
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        opt.zero_grad()
        fast(input_ids=ids, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
        opt.step()
    assert next(model.parameters()).dtype == torch.bfloat16  # the halves are what the model holds
    fast.save_pretrained(str(tmp_path))
    loaded = type(model).from_pretrained(str(tmp_path))
    assert next(loaded.parameters()).dtype == torch.float32
    for k, v in fast.state_dict().items():  # the exact masters, not the halves (3.8e-3 off before)
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)
    assert next(model.parameters()).dtype == torch.bfloat16  # split again after writing
