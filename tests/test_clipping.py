"""``offload.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_``'s norm and gradients bit for bit,
its CPU 2-norms computed on a pool of threads (Note: [Norms on several threads] in
``offload/clipping.py``)."""

from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch
from torch import nn

import offload
from offload import clipping

from .test_optimizer import assert_same, loss_of, pair


def _parameters(dtypes: tuple[torch.dtype, ...], special: str | None = None) -> list[nn.Parameter]:
    """Parameters of mixed sizes (one over the intra-op grain and the bundle size, many small ones),
    each with a gradient but one."""
    generator = torch.Generator().manual_seed(0)
    sizes = [3_000_000, 40_000, 7, 1, 65_537, 2_500_000, 300, 33]
    params = []
    for i, n in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        p = nn.Parameter(torch.zeros(n, dtype=dtype))
        if i != 3:
            p.grad = (torch.randn(n, generator=generator) * (i + 1)).to(dtype)
        params.append(p)
    if special is not None:
        params[1].grad[5] = {"nan": math.nan, "inf": math.inf}[special]
    return params


def _copies(params: list[nn.Parameter]) -> list[nn.Parameter]:
    copies = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        copies.append(q)
    return copies


_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads and signed zeros included)."""
    return a.dtype == b.dtype and torch.equal(a.view(_INTS[a.element_size()]), b.view(_INTS[b.element_size()]))


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float32), (torch.float64,),
                                    (torch.float16, torch.float32)], ids=["f32", "bf16+f32", "f64", "f16+f32"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e9, math.inf])
@pytest.mark.parametrize("foreach", [None, False])
def test_norm_and_gradients_are_torchs_bit_for_bit(dtypes, norm_type, max_norm, foreach):
    ours = _parameters(dtypes)
    theirs = _copies(ours)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=foreach)
    got = offload.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach, num_threads=3)
    assert _bits_equal(got, expected)
    for p, q in zip(ours, theirs):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert _bits_equal(p.grad, q.grad)


@pytest.mark.parametrize("special", ["nan", "inf"])
def test_non_finite_gradients(special):
    ours = _parameters((torch.float32,), special)
    theirs = _copies(ours)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    got = offload.clip_grad_norm_(ours, 0.5)
    assert _bits_equal(got, expected) and not torch.isfinite(got)
    for p, q in zip(ours, theirs):
        if p.grad is not None:
            assert _bits_equal(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="non-finite"):
        offload.clip_grad_norm_(_parameters((torch.float32,), special), 0.5, error_if_nonfinite=True)


def test_an_empty_generator_is_warned_of_as_torch_does_and_a_list_is_not():
    """A filter that keeps no parameter would turn clipping off without a word."""
    layer = nn.Linear(3, 3)
    with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient clipping will occur") as caught:
        norm = offload.clip_grad_norm_((p for p in layer.parameters() if p.ndim > 2), 1.0)
    assert caught[0].filename == __file__  # pointed at the call, as torch's is
    assert norm.item() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.clip_grad_norm_([], 1.0)


def test_under_other_intra_op_thread_counts():
    """A norm PyTorch splits over threads (the 1-norm over the grain) splits as on the caller's
    thread; the 2-norms on the pool are the caller's too."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for norm_type in (1.0, 2.0):
                ours = _parameters((torch.float32,))
                theirs = _copies(ours)
                expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
                assert _bits_equal(offload.clip_grad_norm_(ours, 0.5, norm_type, num_threads=4), expected)
    finally:
        torch.set_num_threads(before)


def test_the_norms_run_on_the_pool(monkeypatch):
    threads = []
    norm = torch.linalg.vector_norm

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return norm(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", recorded)
    offload.clip_grad_norm_(_parameters((torch.float32,)), 0.5, num_threads=2)
    pooled = [name for name in threads if name.startswith("offload-norm")]
    # Seven per-tensor norms on the pool; the stacked norms' norm on the caller.
    assert len(pooled) == 7 and len(threads) == 8


def test_tasks_put_large_tensors_first_and_bundle_small_ones():
    tensors = [torch.empty(n) for n in (10, 4 << 20, 1 << 20, 3 << 20, 20)]
    tasks = clipping._tasks(tensors)
    assert tasks[0] == [1] and tasks[1] == [3]  # 16 MiB and 12 MiB alone, largest first
    assert sorted(i for task in tasks[2:] for i in task) == [0, 2, 4]


def test_a_coefficient_of_one_leaves_the_gradients_untouched():
    params = _parameters((torch.float32,))
    versions = [p.grad._version for p in params if p.grad is not None]
    offload.clip_grad_norm_(params, math.inf)
    assert [p.grad._version for p in params if p.grad is not None] == versions
    offload.clip_grad_norm_(params, 0.5)  # a real clip multiplies
    assert all(p.grad._version > v for p, v in zip([p for p in params if p.grad is not None], versions))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_0_norm_beside_a_nan_gradient_leaves_the_bits_pytorchs(dtype):
    """A count of non-zeros stays finite beside a quiet NaN, whose sign PyTorch's bfloat16
    product by the coefficient one sets: that product is made, as PyTorch makes it."""
    def parameter() -> nn.Parameter:
        p = nn.Parameter(torch.zeros(300, dtype=dtype))
        p.grad = torch.ones(300, dtype=dtype)
        p.grad[3] = float("nan")
        return p
    plain, offloaded = parameter(), parameter()
    expected = torch.nn.utils.clip_grad_norm_([plain], max_norm=1e9, norm_type=0.0)
    got = offload.clip_grad_norm_([offloaded], max_norm=1e9, norm_type=0.0)
    assert _bits_equal(got, expected) and math.isfinite(float(got))
    assert _bits_equal(offloaded.grad, plain.grad)


def test_bad_arguments():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_threads"):
            offload.clip_grad_norm_(_parameters((torch.float32,)), 0.5, num_threads=bad)
    assert _bits_equal(offload.clip_grad_norm_([], 1.0), torch.nn.utils.clip_grad_norm_([], 1.0))
    one = nn.Parameter(torch.ones(3))
    one.grad = torch.full((3,), 2.0)
    assert float(offload.clip_grad_norm_(one, 1.0)) == pytest.approx(math.sqrt(12))


@pytest.mark.parametrize("num_threads", [None, 2])
def test_training_an_offloaded_model_with_it_is_the_plain_models(num_threads):
    """The plain model clipped by PyTorch against the offloaded one clipped by ``offload.clip_grad_norm_``,
    over steps with accumulation."""
    (plain_model, plain), (model, optimizer) = pair(torch.optim.AdamW, {"lr": 1e-2, "fused": True})
    for step in range(3):
        for micro in range(2):
            (loss_of(plain_model, 10 * step + micro) / 2).backward()
            (loss_of(model, 10 * step + micro) / 2).backward()
        expected = torch.nn.utils.clip_grad_norm_(plain_model.parameters(), max_norm=0.05)
        got = offload.clip_grad_norm_(model.parameters(), max_norm=0.05, num_threads=num_threads)
        assert _bits_equal(got, expected)
        for opt in (plain, optimizer):
            opt.step()
            opt.zero_grad()
    assert_same(plain_model, plain, model, optimizer)
