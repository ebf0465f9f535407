"""transformers pipelines take the optimized model in place of the user's (#6: the returned model
behaves like the user's), with a tokenizer built here (no downloads)."""

import numpy as np
import pytest
import torch

import torchkiln as tk

T = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXT = "w5 w6 w7 w8 w9"


@pytest.fixture(scope="module")
def tok():
    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w3"))
    wl.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="w3", pad_token="w0", eos_token="w2",
                                     bos_token="w1")


def _llama():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return T.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("with_sample", [False, True])
def test_text_generation_pipeline_runs_the_fast_decoder(tok, with_sample):
    model = _llama()
    want = T.pipeline("text-generation", model=model, tokenizer=tok)(TEXT, max_new_tokens=6, do_sample=False)
    sample = {"input_ids": tok(TEXT, return_tensors="pt")["input_ids"], "use_cache": False} if with_sample else None
    fast = tk.optimize(model, graph_mode=False, sample_input=sample, time_budget=0)
    got = T.pipeline("text-generation", model=fast, tokenizer=tok)(TEXT, max_new_tokens=6, do_sample=False)
    assert got == want
    report = fast.kiln_llm_report if with_sample else fast.kiln_report
    assert report.path == "fast"  # the pipeline's generate() went through tk.llm, not the model's own


def test_feature_extraction_pipeline_matches(tok):
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=96, pad_token_id=0)).eval()
    want = np.array(T.pipeline("feature-extraction", model=bert, tokenizer=tok)(TEXT))
    fast = tk.optimize(bert, sample_input=dict(tok(TEXT, return_tensors="pt")), time_budget=0)
    got = np.array(T.pipeline("feature-extraction", model=fast, tokenizer=tok)(TEXT))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()  # float32: the guard's bound


def test_inputs_made_under_inference_mode(tok, monkeypatch):
    """Tokenizing inside torch.inference_mode() gives inference tensors, which have no version counter:
    reading it (the selection's snapshot, the all-ones mask check) raised on the first call."""
    _compiled_wins(monkeypatch)  # (the compiled form lost the timing to eager passes on a loaded machine)
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=96, pad_token_id=0)).eval()
    fast = tk.optimize(bert, time_budget=0, candidates="torchkiln")
    with torch.inference_mode():
        batch = dict(tok([TEXT, "w9 w8"], return_tensors="pt", padding=True))
        assert batch["attention_mask"].is_inference()
        got = [fast(**batch).last_hidden_state for _ in range(2)]  # the selection, then a served call
        want = bert(**batch).last_hidden_state
    assert fast.kiln_report.active.startswith("torchkiln compiled")
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)


def test_padding_per_batch_compiles_once_more_not_per_length(monkeypatch):
    """Tokenizing each batch with padding=True gives a new sequence length per batch. The compiled
    candidate recompiled at every one (3-5 s each for this size on a 2-core Zen 5), and after 8 the
    recompile limit moved calls off it; stock torch.compile compiles a dynamic graph on the second
    length. References: the model itself, call for call."""
    import importlib

    from torch._dynamo.utils import counters
    opt_mod = importlib.import_module("torchkiln.optimize")
    monkeypatch.setattr(opt_mod, "interleaved", lambda fns, *a, **k: {  # the compiled candidate wins
        n: [0.001 if n.startswith("torchkiln compiled") else 0.002] * 3 for n in fns})
    monkeypatch.setattr(opt_mod, "blocks", lambda calls, *a, **k: {"served": [0.001] * 3, "given": [0.002] * 3})
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=96, pad_token_id=0)).eval()

    def batch(length):
        ids = torch.randint(3, 96, (2, length))
        mask = torch.ones_like(ids)
        mask[1, length // 2:] = 0
        return {"input_ids": ids, "attention_mask": mask}

    fast = tk.optimize(bert, sample_input=batch(24), candidates="torchkiln", time_budget=0)
    assert fast.kiln_report.active == "torchkiln compiled (float32)"
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for length in (17, 31, 12, 40, 27, 9):
            b = batch(length)
            torch.testing.assert_close(fast(**b).last_hidden_state, bert(**b).last_hidden_state, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] - before == 1  # one dynamic graph for every new length
    assert fast.kiln_report.active == "torchkiln compiled (float32)" and not fast.kiln_report.fallbacks


def test_config_changed_through_the_returned_model(tok):
    """``fast.config.output_hidden_states = True`` reached the original's config, and eager answered
    with the hidden states; the served compiled graph (a copy, with a copy of the config) answered
    without them, silently (the thirtieth session's probes)."""
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=96, pad_token_id=0)).eval()
    batch = dict(tok([TEXT, "w9 w8"], return_tensors="pt", padding=True))
    fast = tk.optimize(bert, sample_input=batch, time_budget=0, candidates="torchkiln")
    assert fast.kiln_report.active.startswith("torchkiln compiled")
    with torch.no_grad():
        assert fast(**batch).hidden_states is None
        fast.config.output_hidden_states = True
        got, want = fast(**batch).hidden_states, bert(**batch).hidden_states
    assert got is not None and len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _segformer():
    torch.manual_seed(0)
    cfg = T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                            num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=3)
    return T.SegformerForSemanticSegmentation(cfg).eval()


def _compiled_wins(monkeypatch):
    """Fixed timings: the compiled candidate is fastest whatever the machine's load (what is tested
    here is that it may compete and answers right, not the selection)."""
    import importlib

    opt_mod = importlib.import_module("torchkiln.optimize")
    monkeypatch.setattr(opt_mod, "interleaved", lambda fns, *a, **k: {
        n: [0.001 if n.startswith("torchkiln compiled") else 0.002] * 3 for n in fns})
    monkeypatch.setattr(opt_mod, "blocks", lambda calls, *a, **k: {"served": [0.001] * 3, "given": [0.002] * 3})


def test_transformers_own_output_capture_hooks_leave_the_compiled_form_in(monkeypatch):
    """transformers 5.x collects hidden states through forward hooks it installs on a model's layers
    the first time a call asks for them; segformer's segmentation head asks at every call. Counted as
    user hooks, they kept every segformer on the model as given (the thirty-sixth session's sweep)."""
    pytest.importorskip("transformers.utils.output_capturing")  # transformers < 5 collects without hooks
    from torchkiln.modelutil import hooked

    _compiled_wins(monkeypatch)

    model, x = _segformer(), torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = model(pixel_values=x).logits
        want_h = model(pixel_values=x, output_hidden_states=True).hidden_states
    assert any(m._forward_hooks for m in model.modules()) and hooked(model) == []
    fast = tk.optimize(model, sample_input={"pixel_values": x}, candidates="torchkiln", time_budget=0)
    with torch.no_grad():
        got = fast(pixel_values=x).logits
        got_h = fast(pixel_values=x, output_hidden_states=True).hidden_states
    assert fast.kiln_report.active.startswith("torchkiln compiled"), str(fast.kiln_report)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(got_h) == len(want_h) == 2
    for g, w in zip(got_h, want_h, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_output_capture_hooks_installed_on_the_original_later_keep_calls_served(tok, monkeypatch):
    """A call on the original that asks for hidden states installs transformers' capture hooks on it
    after optimize: no hook of the user's changed, so calls stay on the served form."""
    pytest.importorskip("transformers.utils.output_capturing")
    _compiled_wins(monkeypatch)
    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=96, pad_token_id=0)).eval()
    batch = dict(tok([TEXT, "w9 w8"], return_tensors="pt", padding=True))
    fast = tk.optimize(bert, sample_input=batch, time_budget=0, candidates="torchkiln")
    with torch.no_grad():
        fast(**batch)
        assert not any(m._forward_hooks for m in bert.modules())
        want = bert(**batch, output_hidden_states=True)  # installs the hooks on the original
        assert any(m._forward_hooks for m in bert.modules())
        assert not fast._hooks.changed()
        got = fast(**batch)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-5)
    assert fast.kiln_report.active.startswith("torchkiln compiled")
