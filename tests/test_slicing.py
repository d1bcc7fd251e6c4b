"""The partition rule: contiguous, never empty, clamped, balanced by bytes."""

from __future__ import annotations

import itertools
import random
import warnings

import pytest
from torch import nn

from offload import OffloadModel
from offload.walk.slicing import layer_nbytes, partition


def brute_force_best(sizes: list[int], k: int) -> int:
    n = len(sizes)
    best = sum(sizes)
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_partition_is_contiguous_non_empty_and_optimal(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 0, 1, 5, 10, 100]) for _ in range(rng.randint(1, 9))]
    k = rng.randint(1, 11)
    ranges = partition(sizes, k)
    assert len(ranges) == min(k, len(sizes))
    assert all(len(r) > 0 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(sizes)))
    assert max(sum(sizes[i] for i in r) for r in ranges) == brute_force_best(sizes, len(ranges))


def test_partition_clamps_to_the_number_of_layers():
    assert partition([3, 3], 10) == [range(0, 1), range(1, 2)]


def test_partition_rejects_bad_requests():
    with pytest.raises(ValueError):
        partition([], 2)
    with pytest.raises(ValueError):
        partition([1], 0)


def test_layer_nbytes_counts_tied_tensors_once():
    shared = nn.Linear(4, 4, bias=False)
    block = nn.Sequential(shared, shared)
    assert layer_nbytes(block) == 4 * 4 * 4


def test_model_with_more_slices_than_layers_says_it_uses_fewer_once():
    layers = [nn.Linear(2, 2) for _ in range(4)]
    with pytest.warns(UserWarning) as caught:
        model = OffloadModel(nn.Sequential(*layers), device="cpu", num_slices=1000)
    assert model.num_slices == 4
    assert [str(w.message) for w in caught] == [
        "num_slices=1000 is more than the model's 4 layers; using 4 slices, one a layer"]
    assert caught[0].filename == __file__  # it points at the caller's line
    # The default (3, or one a layer where there are fewer) and a count the layers allow: nothing said.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OffloadModel(nn.Sequential(*layers[:2]), device="cpu").num_slices == 2
        assert OffloadModel(nn.Sequential(*layers), device="cpu").num_slices == 3
        assert OffloadModel(nn.Sequential(*layers), device="cpu", num_slices=4).num_slices == 4


def test_list_of_modules_is_used_as_given():
    first = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    second = nn.Linear(3, 1)
    model = OffloadModel([first, second], device="cpu", num_slices=5)
    assert model.partition == (("0",), ("1",))
    assert list(model.state_dict()) == list(nn.Sequential(first, second).state_dict())
