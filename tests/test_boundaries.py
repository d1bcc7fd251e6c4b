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
