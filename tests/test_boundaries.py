"""Tensors that cross a slice boundary require grad exactly when they do in the plain model.

An attention mask computed from token ids, or rotary tables carried beside the hidden states, do
not require grad in the plain model; if they did inside OffloadModel, attention would pick other
kernels (results no longer bit-identical) and every slice would compute gradients nobody needs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from offload import OffloadModel

from .helpers import DEVICES, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}
WIDTH, HEADS, VOCAB = 16, 2, 11


class Embed(nn.Module):
    """Token ids in; hidden states, a float attention mask and rotary-like tables out."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids):
        padding = (ids == 0).float()                                        # no grad: from integers
        mask = (padding[:, None, None, :] * torch.finfo(torch.float32).min)  # B x 1 x 1 x T
        positions = torch.arange(ids.shape[1], dtype=torch.float32, device=ids.device)
        cos, sin = positions.cos()[:, None], positions.sin()[:, None]       # no grad: constants
        return self.tokens(ids), mask, (cos, sin)


class Block(nn.Module):
    """Attention with the mask, then an MLP; records what its inputs require."""

    seen: list[tuple[bool, bool, bool, bool]]

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.dropout = dropout
        self.seen = []

    def forward(self, inputs):
        h, mask, (cos, sin) = inputs
        self.seen.append((h.requires_grad, mask.requires_grad, cos.requires_grad, sin.requires_grad))
        b, t, _ = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        q = q * cos + q * sin
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=self.dropout if self.training else 0.0)
        h = h + self.out(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return h + self.mlp(h), mask, (cos, sin)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)

    def forward(self, inputs):
        h, _, _ = inputs
        return self.proj(h)


def network(dropout: float = 0.0, head: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [Embed(), *[Block(dropout) for _ in range(4)]]
    return nn.Sequential(*layers, *([Head()] if head else []))


def token_ids(device: str = "cpu") -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    ids[0, 4:] = 0  # padding
    ids[2, 5:] = 0
    return ids.to(device)


def blocks(model: nn.Module) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("num_slices", [2, 6])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_every_boundary_tensor_requires_grad_as_in_the_plain_model(checkpoint_activation, num_slices,
                                                                   num_microbatches, device):
    plain = network().to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=num_slices,
                         checkpoint_activation=checkpoint_activation, num_microbatches=num_microbatches)
    ids = token_ids(device)
    plain(ids).sum().backward()
    model(ids).sum().backward()
    want = {flags for block in blocks(plain) for flags in block.seen}
    assert want == {(True, False, False, False)}
    for block in blocks(model):
        assert block.seen, "every block ran"
        assert set(block.seen) == want, block.seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_with_a_float_mask_is_bit_identical(checkpoint_activation, dropout, device):
    # On a GPU, attention's kernel depends on which inputs require grad: a mask that required
    # grad inside OffloadModel alone would change the kernel, and the last bits of the result.
    plain = network(dropout).to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=4,
                         checkpoint_activation=checkpoint_activation)
    ids = token_ids(device)
    torch.manual_seed(5)
    want = plain(ids)
    F.cross_entropy(want.flatten(0, 1), ids.flatten()).backward()
    torch.manual_seed(5)
    got = model(ids)
    F.cross_entropy(got.flatten(0, 1), ids.flatten()).backward()
    torch.testing.assert_close(got, want, **EXACT)
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_outputs_that_need_no_gradient_do_not_require_it(checkpoint_activation):
    plain = network(head=False)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3,
                         checkpoint_activation=checkpoint_activation)
    ids = token_ids()
    h, mask, (cos, sin) = model(ids)
    ph, pmask, (pcos, psin) = plain(ids)
    got = [t.requires_grad for t in (h, mask, cos, sin)]
    assert got == [t.requires_grad for t in (ph, pmask, pcos, psin)] == [True, False, False, False]
    # Backward through what does require grad still reaches every parameter.
    h.sum().backward()
    ph.sum().backward()
    assert_same_grads(model, plain, **EXACT)


# -- Note: [Leaves that pass through] (offload/autograd/records.py) ---------------------------------


class Carry(nn.Module):
    """``(h, c) -> (linear(h + c), c')``, where ``c'`` is ``c`` as it came (``how="same"``),
    ``c`` changed in place first (``"in place"``), its conjugate (``"conj"``), or a new tensor
    (``"new"``, ``c + 1``). ``"stash"`` keeps ``c``'s memory (not the tensor) and passes ``c + 1``
    on; ``"revive"`` writes new values into the memory the last ``"stash"`` kept and passes on a
    new tensor over it, at version 1 (its ``set_``), as a new allocation at a freed one's address
    would be at the version it starts at."""

    def __init__(self, how: str, stash: list[torch.UntypedStorage] | None = None):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.how = how
        self.stash = stash

    def forward(self, inputs):
        h, c = inputs
        if self.how == "in place":
            c.mul_(1.5)
        elif self.how == "new":
            c = c + 1.0
        elif self.how == "stash":
            self.stash.append(c.untyped_storage())
            c = c + 1.0
        elif self.how == "revive":
            kept = self.stash[-1]
            torch.empty(0, device=c.device).set_(kept, 0, c.shape).copy_(c * 3.0)
            c = torch.empty(0, device=c.device).set_(kept, 0, c.shape)
        elif self.how == "conj":
            c = c.conj()  # the same memory, viewed alike, at the same version: other values
        # The linear saves h + c, not c, which may change in place later; its weight's gradient
        # depends on c, so a recompute that started from another c would show there.
        return self.linear(h + (c.imag if c.is_complex() else c)), c


class Start(nn.Module):
    def __init__(self, complex_carry: bool = False):
        super().__init__()
        self.complex_carry = complex_carry

    def forward(self, x):
        c = torch.empty(x.shape[0], WIDTH, device=x.device)
        c.copy_(torch.linspace(0.5, 1.5, WIDTH, device=x.device))  # version 1, as "revive"'s tensor is made
        return x, torch.complex(c, c - 1.0) if self.complex_carry else c


def carrying(hows: list[str]) -> nn.Sequential:
    torch.manual_seed(0)
    stash: list[torch.UntypedStorage] = []
    return nn.Sequential(Start("conj" in hows), *[Carry(how, stash) for how in hows], nn.Sequential())


def offloads(model: OffloadModel, monkeypatch) -> tuple[list[int], list[int], list[int]]:
    """From now on, the data pointers of the boundary activations ``model`` offloads, of their
    host copies, and of the host copies it loads back."""
    activations = model._engine.activations
    sources: list[int] = []
    copies: list[int] = []
    loaded: list[int] = []
    offload, load = activations.offload, activations.load

    def counting_offload(tensor):
        host, ticket = offload(tensor)
        sources.append(tensor.untyped_storage().data_ptr())
        copies.append(host.untyped_storage().data_ptr())
        return host, ticket

    def counting_load(ticket, host):
        loaded.append(host.untyped_storage().data_ptr())
        return load(ticket, host)

    monkeypatch.setattr(activations, "offload", counting_offload)
    monkeypatch.setattr(activations, "load", counting_load)
    return sources, copies, loaded


def train_both(hows: list[str], num_microbatches: int, monkeypatch) -> tuple[list[int], list[int], list[int]]:
    """One forward and backward of the plain model and of the offloaded one, one slice per
    layer: outputs and gradients equal bit for bit. Returns what the offloaded one offloaded and
    loaded back (:func:`offloads`)."""
    plain = carrying(hows)
    offloaded = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=len(plain),
                             num_microbatches=num_microbatches)
    seen = offloads(offloaded, monkeypatch)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2))
    # The plain model a microbatch at a time, as the offloaded one runs it.
    expected = [plain(chunk)[0] for chunk in x.chunk(num_microbatches)]
    got = offloaded(x)[0]
    torch.testing.assert_close(got, torch.cat(expected), **EXACT)
    for chunk in reversed(expected):  # backward takes the last microbatch first
        chunk.square().sum().backward()
    got.square().sum().backward()
    assert_same_grads(offloaded, plain, **EXACT)
    return seen


# Offloads of a model of k Carry layers, one slice per layer: the input at the first boundary; at
# the second, the carried tensor only (Start returns its input as the hidden state, which went to
# the host already); at each later one of the k - 1 that are checkpointed, the hidden state, and the
# carried tensor only where it changed. With two microbatches the last slice's first run is
# checkpointed too: one more boundary. Backward loads each host copy once, and again for a
# recompute that follows one which changed the shared device copy in place.


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_leaf_that_passes_through_unchanged_goes_to_the_host_and_back_once(num_microbatches, monkeypatch):
    offloaded, copies, loaded = train_both(["same"] * 4, num_microbatches, monkeypatch)
    assert len(offloaded) == num_microbatches * (1 + 1 + 3) + (num_microbatches - 1)
    assert sorted(loaded) == sorted(copies)


def test_a_leaf_changed_in_place_between_boundaries_goes_to_the_host_and_back_again(monkeypatch):
    # Changed by layers 2 and 4: after layer 2 at a checkpointed boundary, after layer 4 at none.
    offloaded, copies, loaded = train_both(["same", "in place", "same", "in place"], 1, monkeypatch)
    assert len(offloaded) == 1 + 1 + 3 + 1
    # The carried tensor's two host copies (after the embedding, after layer 2): the recomputes of
    # layers 4 and 2 change the device copy that those of layers 3 and 1 start from, which load
    # their own.
    first, second = copies[1], copies[4]  # [x, c, h2, h3, c changed, h4]
    assert loaded.count(first) == 2 and loaded.count(second) == 2 and len(loaded) == len(copies) + 2


def test_a_new_leaf_at_the_address_of_a_freed_one_goes_to_the_host_again(monkeypatch):
    """Layer 3 passes on a new tensor over the memory of the tensor that entered layer 1, freed
    since, with other values and at the version that one had: it is the same memory, viewed
    alike, at the same version, and yet not the leaf offloaded then."""
    offloaded, _, _ = train_both(["stash", "same", "revive", "same"], 1, monkeypatch)
    assert offloaded.count(offloaded[1]) == 2  # the carried tensor at the second boundary, and at the fourth again
    assert len(offloaded) == 1 + 1 + 3 + 2  # c + 1 after layer 1, the revived one after layer 3


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("hows", [["same", "same", "in place"], ["same", "same", "same", "in place", "same"]],
                         ids=["three", "four"])
def test_a_leaf_shared_by_three_or_more_checkpoints_and_changed_by_the_last_is_loaded_again(hows, num_microbatches,
                                                                                           monkeypatch):
    """Backward meets the slice that changes the leaf first: its recompute changes the shared
    device copy, which the next run's load, handed out ahead, and every later one must not see."""
    train_both(hows, num_microbatches, monkeypatch)


def test_a_conjugate_view_of_a_passing_leaf_is_not_taken_for_it(monkeypatch):
    offloaded, _, _ = train_both(["same", "conj", "same"], 1, monkeypatch)
    assert len(offloaded) == 1 + 1 + 2 + 1  # the conjugate view after layer 2, offloaded too


def test_a_shared_device_copy_is_let_go_after_its_last_recompute(monkeypatch):
    """A carried tensor replaced every second layer: at most two device copies at a time (the
    running slice's and the next one's, loaded ahead), not one for each pair."""
    from offload.autograd.records import SharedCopies

    most = [0]
    keep = SharedCopies.keep

    def counting(self, leaf, tensor, ready):
        keep(self, leaf, tensor, ready)
        most[0] = max(most[0], len(self._copies))

    monkeypatch.setattr(SharedCopies, "keep", counting)
    train_both(["same", "new"] * 4, 1, monkeypatch)
    assert most[0] == 2
