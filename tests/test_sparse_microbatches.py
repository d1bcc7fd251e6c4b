"""Sparse tensors meeting microbatches (Note: [Sparse tensors carrying the batch] in
``offload/walk/microbatch.py``).

A sparse input whose dim 0 is the batch is cut like a dense one and a sparse output with the
batch's rows is joined again; one with another dim 0 (a graph's adjacency) goes whole to every
microbatch and comes back whole. Each test compares bit for bit with the plain layers run slice by
slice on each chunk in turn, which is what OffloadModel computes with microbatches.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

from offload import OffloadModel
from offload.walk.microbatch import split_leaves

from .helpers import ACTIVATIONS, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}
MODES = ["recompute", "kept", "offload_all"]
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

#: How each layout is made from a dense batch.
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "coo": lambda dense: dense.to_sparse(),
    "csr": lambda dense: dense.to_sparse_csr(),
}


class Bag(nn.Module):
    """A sparse bag of words a row in, passed on beside the features it makes."""

    def __init__(self, vocabulary: int, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(vocabulary, width))
        self.l = nn.Linear(width, width)

    def forward(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        words, h = inputs if isinstance(inputs, tuple) else (inputs, 0.0)
        return words, torch.tanh(self.l(words @ self.w + h))


def _bag_of_words(rows: int, vocabulary: int) -> torch.Tensor:
    return (torch.rand(rows, vocabulary) > 0.7).float() * torch.randn(rows, vocabulary)


def _chunked(plain: nn.Sequential, model: OffloadModel, chunks: list[Any]) -> list[Any]:
    """Each chunk's output: the plain layers slice by slice on each chunk in turn."""
    for names in model.partition:
        chunks = [_through(plain, names, chunk) for chunk in chunks]
    return chunks


def _through(layers: nn.Sequential, names: Any, value: Any) -> Any:
    for name in names:
        value = layers._modules[name](value)
    return value


def _assert_same_sparse(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.layout, got.shape) == (want.layout, want.shape)
    if want.layout == torch.sparse_coo:
        pairs = [(got._indices(), want._indices()), (got._values(), want._values())]
    else:
        pairs = [(got.crow_indices(), want.crow_indices()), (got.col_indices(), want.col_indices()),
                 (got.values(), want.values())]
    for g, w in pairs:
        torch.testing.assert_close(g, w, **EXACT)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sparse_input_carrying_the_batch_is_cut_and_joined_bit_for_bit(layout, mode):
    # Was NotImplementedError (aten::as_strided on SparseCPU) or "Sparse CSR tensors do not have strides".
    torch.manual_seed(0)
    plain = nn.Sequential(Bag(10, 6), Bag(10, 6), Bag(10, 6))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3, num_microbatches=2, **ACTIVATIONS[mode])
    dense = _bag_of_words(5, 10)
    words = LAYOUTS[layout](dense)
    want = _chunked(plain, model, [LAYOUTS[layout](dense[:3]), LAYOUTS[layout](dense[3:])])
    got = model(words)
    torch.testing.assert_close(got[1], torch.cat([w[1] for w in want]), **EXACT)
    _assert_same_sparse(got[0], words)  # the words passed on, joined again
    got[1].pow(2).sum().backward()
    sum(w[1].pow(2).sum() for w in want).backward()
    assert_same_grads(model, plain, **EXACT)
    with torch.no_grad():  # the walk without a graph cuts and joins alike
        again = model(words)
    torch.testing.assert_close(again[1], got[1], **EXACT)
    _assert_same_sparse(again[0], words)


def test_a_csr_inputs_chunks_are_views_of_its_values_and_a_coo_inputs_are_its_rows():
    dense = _bag_of_words(5, 4)
    csr = dense.to_sparse_csr()
    chunks, split = split_leaves([csr], 2)
    assert split.sizes == (3, 2) and split.carries_batch == (True,)
    assert chunks[1][0].values().untyped_storage().data_ptr() == csr.values().untyped_storage().data_ptr()
    for m, rows in enumerate([slice(0, 3), slice(3, 5)]):
        torch.testing.assert_close(chunks[m][0].to_dense(), dense[rows], **EXACT)
        _assert_same_sparse(split_leaves([dense.to_sparse()], 2)[0][m][0], dense[rows].to_sparse())


class GraphConv(nn.Module):
    """A batch of graphs that share one sparse ``[nodes, nodes]`` adjacency, passed on unchanged."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.l = nn.Linear(width, width)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, adjacency = inputs
        return torch.relu(torch.stack([torch.sparse.mm(adjacency, self.l(graph)) for graph in h])), adjacency


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sparse_adjacency_beside_a_batch_of_graphs_goes_whole_and_comes_back_whole(layout, mode):
    # Was refused at the join: "does not carry the batch dimension ... and is not the same in every microbatch".
    torch.manual_seed(0)
    plain = nn.Sequential(GraphConv(4), GraphConv(4), GraphConv(4))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3, num_microbatches=3, **ACTIVATIONS[mode])
    adjacency = LAYOUTS[layout]((torch.rand(5, 5) > 0.5).float() * torch.rand(5, 5))
    h = torch.randn(6, 5, 4)
    want = _chunked(plain, model, [(chunk, adjacency) for chunk in h.split(2)])
    got = model((h, adjacency))
    torch.testing.assert_close(got[0], torch.cat([w[0] for w in want]), **EXACT)
    _assert_same_sparse(got[1], adjacency)
    got[0].pow(2).sum().backward()
    sum(w[0].pow(2).sum() for w in want).backward()
    assert_same_grads(model, plain, **EXACT)
    with torch.no_grad():
        _assert_same_sparse(model((h, adjacency))[1], adjacency)


class Counting(nn.Linear):
    calls = 0

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        Counting.calls += 1
        return super().forward(inputs[0])


def test_a_sparse_layout_that_cannot_be_cut_is_refused_naming_the_input_before_any_slice_runs():
    # Was "Sparse CSC tensors do not have strides", raised by torch.split with no word of what to do.
    model = OffloadModel(nn.Sequential(Counting(4, 4), nn.Linear(4, 4)), device="cpu", num_slices=2,
                         num_microbatches=2)
    Counting.calls = 0
    with pytest.raises(ValueError, match=r"input leaf 1 .*sparse_csc.*to_sparse_coo\(\).*num_microbatches=1"):
        model((torch.randn(5, 4), _bag_of_words(5, 4).to_sparse_csc()))
    assert Counting.calls == 0
    # A dim 0 other than the batch's goes whole to every microbatch: nothing to cut.
    assert model((torch.randn(5, 4), _bag_of_words(3, 4).to_sparse_csc())).shape == (5, 4)


class ToCsc(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse_csc()


def test_a_sparse_output_that_cannot_be_joined_is_refused_saying_what_to_return():
    # Was "Sparse CSC tensors do not have is_contiguous", raised by torch.cat.
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), ToCsc()), device="cpu", num_slices=2, num_microbatches=2)
    with torch.no_grad(), pytest.raises(ValueError, match=r"output leaf 0 .*sparse_csc.*to_sparse_coo\(\)"):
        model(torch.randn(5, 4))


class ToSparse(nn.Module):
    """Hands on its input as a sparse tensor: an output that needs a gradient."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse_coo() if self.layout == torch.sparse_coo else x.to_sparse_csr()


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_a_sparse_output_that_needs_a_gradient_takes_it_cut_into_the_microbatches(layout):
    # Its to_dense() in the loss gives it a sparse gradient, which backward cuts as forward joined.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), ToSparse(layout))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, num_microbatches=2)
    x = torch.randn(6, 6)
    for chunk in x.chunk(2):  # the plain model microbatch by microbatch
        plain(chunk).to_dense().pow(2).sum().backward()
    model(x).to_dense().pow(2).sum().backward()
    assert_same_grads(model, plain, **EXACT)
