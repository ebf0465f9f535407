"""torchkiln/watch.py: the per-call weight-change check, in its C form (kernels/weight_watch.cpp)
and its Python form. The reference for "changed" is the edit each case makes; both forms must
answer it, and answer alike after every edit of a random sequence."""

import random
import sys

import pytest
import torch
from torch import nn

import torchkiln as tk
from torchkiln import watch as watch_mod
from torchkiln.kernels import weight_watch
from torchkiln.watch import WeightWatch


def native_or_skip():
    module, why = weight_watch.load()
    if module is None:
        pytest.skip(f"the C check cannot be built here: {why}")
    return module


def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).eval()
    m[2].gain = torch.ones(())  # a plain tensor attribute (not a registered buffer)
    return m


def watched(m, native: bool, monkeypatch):
    if native:
        native_or_skip()
    else:
        monkeypatch.setattr(watch_mod, "_native", lambda build: None)
    w = WeightWatch(m)
    w.remember()
    assert w.native == native
    return w


def in_place(m):
    with torch.no_grad():
        m[0].weight.mul_(0.5)


def data_swap(m):
    m[0].bias.data = m[0].bias.data.clone()


def new_parameter(m):
    m[2].weight = nn.Parameter(m[2].weight.detach().clone())


def buffer_write(m):
    with torch.no_grad():
        m[1].running_mean.add_(1)


def loaded(m):
    m.load_state_dict(model().state_dict())


def assigned(m):
    m.load_state_dict(model().state_dict(), assign=True)


def swapped_layer(m):
    m[2] = nn.Linear(8, 4)
    m[2].gain = torch.ones(())


def attribute_set(m):
    m[1].eps = m[1].eps * 2


def submodule_train(m):
    m[1].train(not m[1].training)


def tensor_attribute_write(m):
    m[2].gain.add_(1)


def tensor_attribute_replaced(m):
    m[2].gain = torch.zeros(())


def deleted(m):
    del m[2]._parameters["bias"]


EDITS = [in_place, data_swap, new_parameter, buffer_write, loaded, assigned, swapped_layer, attribute_set,
         submodule_train, tensor_attribute_write, tensor_attribute_replaced, deleted]
TAGS = sys.version_info < (3, 13)  # where the C form reads dict version tags (weight_watch.cpp)


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__)
def test_each_recorded_change_is_seen(edit, native, monkeypatch):
    m = model()
    w = watched(m, native, monkeypatch)
    assert (w._seen[6] is not None) == (native and TAGS)  # else the tag shortcut goes untested
    assert not w.changed()
    m(torch.randn(2, 8))  # an eval call writes nothing
    assert not w.changed()
    edit(m)
    assert w.changed()
    assert w.changed()  # and stays changed
    w.remember()
    assert not w.changed()


def test_a_dict_change_that_moves_no_slot_is_not_a_change_and_is_cheap_again(monkeypatch):
    """A new private attribute moves the module dict's version tag but no watched slot: the lookups
    find nothing, and the saved tags are brought up to date (the next check skips the lookups)."""
    m = model()
    w = watched(m, True, monkeypatch)
    if not TAGS:
        pytest.skip("no dict version tags on this Python")
    c, saved = w._seen[4], w._seen[6]
    m[0]._note = "x"
    assert c.tags(w._tag_dicts) != saved
    assert not w.changed()
    assert c.tags(w._tag_dicts) == saved
    attribute_set(m)
    assert w.changed()


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
def test_writes_through_data_are_not_seen(native, monkeypatch):
    # the documented blind spot (watch.py): p.data has its own version counter
    m = model()
    w = watched(m, native, monkeypatch)
    m[0].weight.data.mul_(2)
    assert not w.changed()


def test_the_two_forms_agree_over_a_random_sequence_of_edits(monkeypatch):
    native_or_skip()
    rng = random.Random(0)
    m = model()
    c = WeightWatch(m)
    c.remember()
    with monkeypatch.context() as mp:
        mp.setattr(watch_mod, "_native", lambda build: None)
        p = WeightWatch(m)
        p.remember()
    seen = 0
    for _ in range(40):
        if rng.random() < 0.5:
            rng.choice(EDITS[:-1])(m)  # deleting twice would raise
        assert c.changed() == p.changed()
        if c.changed():
            seen += 1
            c.remember()
            p.remember()
    assert seen > 5


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
def test_ignored_slots_are_not_watched(native, monkeypatch):
    m = model()
    w = watched(m, native, monkeypatch)
    w.ignore([m[1].running_mean], [(vars(m[1]), "eps")])
    w.remember()
    buffer_write(m)
    attribute_set(m)
    assert not w.changed()
    in_place(m)
    assert w.changed()


def test_no_snapshot_means_nothing_changed():
    assert not WeightWatch(model()).changed()


def test_the_c_module_rejects_bad_arguments():
    c = native_or_skip()
    t = torch.zeros(2)
    state = c.snapshot([t])
    with pytest.raises(TypeError, match="tensors must be a list"):
        c.snapshot((t,))
    with pytest.raises(TypeError, match=r"tensors\[1\] is not a tensor"):
        c.snapshot([t, 3])
    with pytest.raises(ValueError, match="same slots"):
        c.changed([{"w": t}], ["w"], [t, t], state)
    with pytest.raises(TypeError, match=r"dicts\[0\] is not a dict"):
        c.changed([["w"]], ["w"], [t], state)
    assert not c.changed([{"w": t}], ["w"], [t], state)
    assert c.changed([{"w": t}], ["v"], [t], state)
    with pytest.raises(ValueError, match="same slots"):
        c.changed([], [], [], state)  # a state for more tensors than there are slots
    mod, other = nn.ReLU(), nn.ReLU()
    assert not c.changed([{"w": t}, {"act": mod}], ["w", "act"], [t, mod], state)  # identity-only slot after
    assert c.changed([{"w": t}, {"act": other}], ["w", "act"], [t, mod], state)
    d = {"w": t}
    with pytest.raises(TypeError, match=r"tag_dicts\[0\] is not a dict"):
        c.tags([["w"]])
    if TAGS:
        with pytest.raises(ValueError, match="tags must be"):
            c.changed([d], ["w"], [t], state, [d, {}], c.tags([d]))
        tags = c.tags([d])
        assert not c.changed([d], ["w"], [t], state, [d], tags)
        d["w"] = torch.zeros(2)
        assert c.changed([d], ["w"], [t], state, [d], tags)
    else:
        assert c.tags([d]) is None


class Scaled(nn.Module):
    """A forward that reads plain attributes: a tensor (not a buffer), a float and a flag."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale, self.temperature, self.relu = torch.tensor(2.0), 1.0, False

    def forward(self, x):
        y = self.lin(x) * self.scale / self.temperature
        return torch.relu(y) if self.relu else y


def scale_in_place(m):
    m.scale.fill_(3.0)


def scale_replaced(m):
    m.scale = torch.tensor(4.0)


def temperature(m):
    m.temperature = 0.5


def flag(m):
    m.relu = True


@pytest.mark.parametrize("edit", [scale_in_place, scale_replaced, temperature, flag], ids=lambda f: f.__name__)
def test_optimize_notices_plain_attributes_set_after_it(edit):
    """Every traced or compiled form answered with the values read when it was built (the stock
    compile missed only the in-place write), silently: the twenty-eighth session's probes."""
    m, x = Scaled().eval(), torch.randn(8, 16)
    o = served_by_a_copy(m, x)
    with torch.no_grad():
        edit(m)
        torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-5)


def served_by_a_copy(m, x):
    """``m`` optimized and called once, served by a form that holds its own copy of what it read."""
    torch.manual_seed(0)
    o = tk.optimize(m, sample_input=x, candidates="torchkiln", time_budget=0.2)
    with torch.no_grad():
        o(x)
    assert not o._served.live_weights, o.kiln_report.active
    return o


class Settings:
    """A settings object shared by modules, as a transformers config is."""

    def __init__(self):
        self.scale, self._relu = 2.0, False


class Configured(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = Settings()
        self.lin = nn.Linear(16, 16)
        self.lin.cfg = self.cfg

    def forward(self, x):
        y = self.lin(x) * self.cfg.scale
        return torch.relu(y) if self.lin.cfg._relu else y


@pytest.mark.parametrize("edit", ["scale", "_relu"])
def test_optimize_notices_a_settings_object_changed_after_it(edit):
    """``model.config.output_hidden_states = True`` changed eager's outputs; every copy torchkiln
    built kept its own config and answered as before, silently (the thirtieth session's probes)."""
    m, x = Configured().eval(), torch.randn(8, 16)
    o = served_by_a_copy(m, x)
    with torch.no_grad():
        setattr(o.cfg, edit, 0.5 if edit == "scale" else True)  # through the returned model, as users reach it
        ref = m.lin(x) * m.cfg.scale
        torch.testing.assert_close(o(x), ref.relu() if edit == "_relu" else ref, rtol=1e-4, atol=1e-5)


def test_attributes_set_on_the_returned_model_are_the_originals():
    """``fast.temperature = 0.5`` landed on the wrapper: read back it said 0.5, while every call went on
    with the original's 1.0 (the thirtieth session's probes)."""
    m, x = Scaled().eval(), torch.randn(8, 16)
    o = served_by_a_copy(m, x)
    with torch.no_grad():
        o.temperature = 0.5
        o.lin = nn.Linear(16, 16)
        assert m.temperature == 0.5 and m.lin is o.lin
        torch.testing.assert_close(o(x), m.lin(x) * 2.0 / 0.5, rtol=1e-4, atol=1e-5)
    o.tag = "mine"
    assert m.tag == "mine"
    del o.tag
    assert not hasattr(m, "tag")
    o._private = 1  # the wrapper's own names stay its own
    assert "_private" not in vars(m) and o._private == 1


def test_optimize_notices_a_swapped_layer():
    """Replacing a submodule after optimize (a new head) brings weights no watched slot held: the
    served copy answered with the old layer (max diff 0.66 on a probe) until submodule slots were watched."""
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    o = tk.optimize(m, sample_input=x, candidates="torchkiln")
    assert not o._served.live_weights
    m[2] = nn.Linear(32, 4)
    with torch.no_grad():
        torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-5)


def test_refresh_rebuilds_after_writes_through_data():
    m = model()
    x = torch.randn(4, 8)
    o = tk.optimize(m, sample_input=x, candidates="torchkiln")
    assert not o._served.live_weights  # a compiled graph with its own copy of the weights
    m[0].weight.data.mul_(2)
    tk.refresh(o)
    torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-5)


def test_refresh_names_what_it_expects():
    with pytest.raises(TypeError, match="refresh\\(\\) expects a model returned by tk.optimize\\(\\).*Sequential"):
        tk.refresh(model())


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
def test_weights_made_under_inference_mode(native, monkeypatch):
    """Inference tensors have no version counter (reading it raises; in C it aborted the process):
    replacing them is still seen, in-place writes (possible only in inference mode) are not."""
    with torch.inference_mode():
        m = model()
    assert m[0].weight.is_inference()
    w = watched(m, native, monkeypatch)
    assert not w.changed()
    with torch.inference_mode():
        m[0].weight.mul_(2)
    assert not w.changed()  # the documented blind spot (watch.py)
    data_swap(m)
    assert w.changed()
    w.remember()
    new_parameter(m)
    assert w.changed()


def test_optimize_serves_a_model_made_under_inference_mode():
    with torch.inference_mode():
        m = model()
        x = torch.randn(4, 8)
    o = tk.optimize(m, sample_input=x, candidates="torchkiln")
    assert not o._served.live_weights  # compiled, or eager with the BatchNorm folded: copies, so checked
    with torch.no_grad():
        torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-5)
        m[2].weight = nn.Parameter(torch.randn(4, 8))  # a replaced weight is still seen
        torch.testing.assert_close(o(x), m(x), rtol=1e-4, atol=1e-5)
