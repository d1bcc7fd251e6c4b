"""What a checkpoint holds beside tensors comes back as it was, and a load does what
``model.load_state_dict()`` does beside its copies: ``extra`` with int and tuple keys and dict
subclasses, another optimizer's ``state_dict()`` in ``extra`` (Note: [Checkpoint layout] in
offload/checkpoint/contents.py), modules' extra states (``get_extra_state()``), load post-hooks
(Note: [Module load hooks]), and a load of ``None``, the path a first run gets from
``latest_checkpoint()``."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from offload import CheckpointError, OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint, save_checkpoint

from .test_checkpoint import assert_untouched, snapshot, trained
from .test_checkpoint_extra_and_damage import assert_same


def counted_words():
    words = collections.defaultdict(list)
    words["seen"].append(3)
    return words


EXTRAS = {
    "int-keys": lambda: {0: 120, 1: 64},
    "tuple-keys": lambda: {(0, 1): "x", (2, 3): torch.arange(3)},
    "int-keys-tensor-values": lambda: {0: torch.ones(2), 1: torch.zeros(2, dtype=torch.float64)},
    "defaultdict": counted_words,
    "ordereddict": lambda: collections.OrderedDict([("b", 1), ("a", {2: "two"})]),
    "counter": lambda: collections.Counter("abca"),
    "nested": lambda: {"positions": {0: {1: [2, {3: 4}]}}, "seen": counted_words()},
}


# -- extra -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", EXTRAS.values(), ids=EXTRAS.keys())
def test_extra_with_other_keys_than_str_and_dict_subclasses_comes_back_as_it_was(tmp_path, make):
    save_checkpoint(tmp_path / "c", *trained(), extra={"v": make()})
    loaded = load_checkpoint(tmp_path / "c", *trained())["v"]
    assert_same(loaded, make())  # the same types all the way down, keys included


def test_a_defaultdict_in_extra_keeps_its_default_factory(tmp_path):
    save_checkpoint(tmp_path / "c", *trained(), extra=counted_words())
    loaded = load_checkpoint(tmp_path / "c", *trained())
    loaded["new"].append(1)
    assert loaded == {"seen": [3], "new": [1]}


def critic():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return net, torch.optim.Adam(net.parameters(), lr=0.1)


def critic_step(net, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    net(torch.randn(5, 3, generator=generator)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_second_optimizers_state_dict_in_extra_loads_into_a_fresh_one_with_state_on_every_parameter(tmp_path):
    """A GAN's critic: its optimizer's ``state_dict()`` is keyed by parameter number."""
    net, optimizer = critic()
    critic_step(net, optimizer, 0)
    save_checkpoint(tmp_path / "c", *trained(), extra={"critic": net.state_dict(), "critic_opt": optimizer.state_dict()})
    extra = load_checkpoint(tmp_path / "c", *trained())
    assert_same(extra["critic_opt"], optimizer.state_dict())
    resumed_net, resumed = critic()
    resumed_net.load_state_dict(extra["critic"])
    resumed.load_state_dict(extra["critic_opt"])
    assert all(set(resumed.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in resumed_net.parameters())
    assert all(isinstance(key, torch.Tensor) for key in resumed.state)  # no stray state under '0', '1'...
    critic_step(net, optimizer, 1)
    critic_step(resumed_net, resumed, 1)
    for a, b in zip(net.parameters(), resumed_net.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # the next step, bit for bit


def test_what_optimizer_state_dict_post_hooks_add_keeps_its_int_keys(tmp_path):
    model, optimizer = trained()
    optimizer.register_state_dict_post_hook(lambda opt, state_dict: state_dict.update(positions={0: 7, (1, 2): 8}))
    seen = []
    save_checkpoint(tmp_path / "c", model, optimizer)
    model, optimizer = trained()
    optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: seen.append(state_dict.get("positions")))
    load_checkpoint(tmp_path / "c", model, optimizer)
    assert seen == [{0: 7, (1, 2): 8}]


# -- modules' extra state --------------------------------------------------------------------------


class Counting(nn.Linear):
    """Counts its forwards, kept in its extra state (int keys, to be kept as they are)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.set_calls = []

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self):
        return {"calls": self.calls, "by_rank": {0: self.calls}}

    def set_extra_state(self, state):
        self.set_calls.append(state)
        self.calls = state["calls"]


class Growing(nn.Linear):
    """Keeps a tensor as its extra state, of a length that changes as it runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = torch.zeros(0)

    def forward(self, x):
        self.history = torch.cat([self.history, x.detach().sum().reshape(1)])
        return super().forward(x)

    def get_extra_state(self):
        return self.history

    def set_extra_state(self, state):
        self.history = state


def counting_model(wrapped):
    torch.manual_seed(0)
    model = nn.Sequential(Counting(4, 4), nn.Tanh(), Growing(4, 4), nn.Tanh(), nn.Linear(4, 2))
    return OffloadModel(model, device="cpu", num_slices=2) if wrapped else model


def counting_optimizer(model, wrapped):
    return OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True) if wrapped else torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "OffloadModel"])
def test_modules_extra_states_are_saved_and_set_on_load_as_load_state_dict_sets_them(tmp_path, wrapped):
    model = counting_model(wrapped)
    optimizer = counting_optimizer(model, wrapped)
    for step in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(tmp_path / "c", model, optimizer)
    resumed = counting_model(wrapped)
    load_checkpoint(tmp_path / "c", resumed, counting_optimizer(resumed, wrapped))
    reference = counting_model(False)
    reference.load_state_dict(model.state_dict())
    assert resumed[0].set_calls == reference[0].set_calls == [{"calls": 3, "by_rank": {0: 3}}]
    assert resumed[0].calls == 3
    torch.testing.assert_close(resumed[2].history, model[2].history, rtol=0, atol=0)
    for name, tensor in model.state_dict().items():
        assert_same(resumed.state_dict()[name], tensor)


def test_a_checkpoint_without_a_modules_extra_state_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "c", nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                                                  nn.Linear(4, 2)))
    model = counting_model(False)
    before = {name: value.clone() for name, value in model.state_dict().items() if isinstance(value, torch.Tensor)}
    with pytest.raises(CheckpointError, match=r"holds another model: 0\._extra_state \(extra state\) is not in the "
                                              r"checkpoint; 2\._extra_state \(extra state\) is not in the checkpoint"):
        load_checkpoint(tmp_path / "c", model)
    assert model[0].set_calls == []
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in before.items())
    save_checkpoint(tmp_path / "d", counting_model(False))
    with pytest.raises(CheckpointError, match=r"0\._extra_state \(extra state\) is not in the model"):
        load_checkpoint(tmp_path / "d", nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                                                      nn.Linear(4, 2)))


def test_a_state_dict_entry_that_is_neither_tensor_nor_extra_state_is_refused_before_anything_is_written(tmp_path):
    model, optimizer = trained()
    model.register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata:
                                        state_dict.update({"note": "added by a hook"}))
    with pytest.raises(TypeError, match=r"model.state_dict\(\) holds 'note', a str: neither a parameter, a buffer "
                                        r"nor a module's get_extra_state\(\)"):
        save_checkpoint(tmp_path / "c", model, optimizer)
    assert not tmp_path.joinpath("c").exists() and latest_checkpoint(tmp_path) is None


# -- load post-hooks -------------------------------------------------------------------------------


class Cached(nn.Linear):
    """Keeps ``weight.T`` in a buffer it does not save, refreshed by its load post-hook."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_t", self.weight.detach().t().contiguous(), persistent=False)
        self.register_load_state_dict_post_hook(Cached.refresh)

    def refresh(self, incompatible_keys):
        with torch.no_grad():
            self.weight_t.copy_(self.weight.t())

    def forward(self, x):
        return x @ self.weight_t + self.bias


def cached_model(seed, wrapped):
    torch.manual_seed(seed)
    model = nn.Sequential(Cached(4, 4), nn.Tanh(), nn.Linear(4, 2))
    return OffloadModel(model, device="cpu", num_slices=2) if wrapped else model


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "OffloadModel"])
def test_load_post_hooks_run_as_load_state_dict_runs_them(tmp_path, wrapped):
    save_checkpoint(tmp_path / "c", cached_model(0, wrapped))
    model = cached_model(1, wrapped)
    calls = []
    for name, module in [("", model), ("0", model[0]), ("2", model[2])]:
        module.register_load_state_dict_post_hook(
            lambda module, keys, name=name: calls.append((name, list(keys.missing_keys), list(keys.unexpected_keys))))
    load_checkpoint(tmp_path / "c", model)
    reference = cached_model(1, False)
    reference.register_load_state_dict_post_hook(lambda module, keys: None)
    reference.load_state_dict(cached_model(0, False).state_dict())
    assert calls == [("0", [], []), ("2", [], []), ("", [], [])]  # children first, with nothing missing
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(model[0].weight_t, reference[0].weight.t(), rtol=0, atol=0)


def test_a_load_post_hook_that_reports_a_missing_key_raises_as_load_state_dict_does(tmp_path):
    save_checkpoint(tmp_path / "c", cached_model(0, False))
    model = cached_model(1, False)
    model[2].register_load_state_dict_post_hook(lambda module, keys: keys.missing_keys.append("2.scale"))
    with pytest.raises(RuntimeError, match=r"missing keys \['2.scale'\]"):
        load_checkpoint(tmp_path / "c", model)


# -- a first run -----------------------------------------------------------------------------------


def test_loading_none_from_latest_checkpoint_of_a_first_run_says_to_start_fresh(tmp_path):
    model, optimizer = trained()
    before = snapshot(model, optimizer)
    assert latest_checkpoint(tmp_path / "run") is None
    with pytest.raises(CheckpointError, match=r"got None for the path: latest_checkpoint\(\) returns None when nothing "
                                              r"was saved in that directory yet\. On a first run, start fresh"):
        load_checkpoint(latest_checkpoint(tmp_path / "run"), model, optimizer)
    assert_untouched(before, model, optimizer)


def test_an_offload_json_whose_extra_states_are_not_names_is_refused_as_damaged(tmp_path):
    save_checkpoint(tmp_path / "c", counting_model(False))
    info_file = tmp_path / "c" / "offload.json"
    info_file.write_text(info_file.read_text().replace('"extra_states": [', '"extra_states": [0, '))
    with pytest.raises(CheckpointError, match=r"is damaged, or was not written by offload: .*\('extra_states' is "
                                              r"\[0, '0._extra_state', '2._extra_state'\]\)"):
        load_checkpoint(tmp_path / "c", counting_model(False))
