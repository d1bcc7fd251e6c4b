"""Cutting batches into microbatches and joining the pieces back."""

from __future__ import annotations

import pytest
import torch

from offload.walk.microbatch import join_input_grads, join_outputs, split_leaves, split_like


def test_split_cuts_batch_carrying_leaves_and_shares_the_rest():
    x = torch.arange(10.0).reshape(5, 2)
    mask = torch.ones(2)
    chunks, split = split_leaves([x, mask, 3, None], 2)
    assert split.sizes == (3, 2)
    assert split.carries_batch == (True, False, False, False)
    assert torch.equal(chunks[0][0], x[:3]) and torch.equal(chunks[1][0], x[3:])
    assert chunks[0][1] is mask and chunks[1][1] is mask
    assert chunks[1][2] == 3


def test_split_never_makes_empty_microbatches():
    chunks, split = split_leaves([torch.zeros(2, 3)], 5)
    assert split.sizes == (1, 1)
    assert len(chunks) == 2


def test_split_without_a_batch_dimension_is_one_microbatch():
    chunks, split = split_leaves([torch.tensor(1.0), "x"], 4)
    assert split.count == 1 and len(chunks) == 1


def test_join_concatenates_and_rejects_non_batch_tensors():
    joined = join_outputs([[torch.zeros(2, 1), "a"], [torch.ones(3, 1), "a"]], (2, 3))
    assert joined[0].shape == (5, 1) and joined[1] == "a"
    with pytest.raises(ValueError, match="does not carry the batch dimension"):
        join_outputs([[torch.zeros(())], [torch.zeros(())]], (2, 3))


def test_split_like_and_join_input_grads_are_inverse():
    grad = torch.arange(5.0)
    parts = split_like(grad, (2, 3))
    assert torch.equal(join_input_grads(parts, (2, 3), True, torch.Size([]), torch.float32), grad)
    shared = join_input_grads([torch.ones(2), None, torch.ones(2)], (1, 1, 1), False, torch.Size([2]), torch.float32)
    assert torch.equal(shared, torch.full((2,), 2.0))
    filled = join_input_grads([torch.ones(1, 2), None], (1, 2), True, torch.Size([2]), torch.float32)
    assert torch.equal(filled, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
