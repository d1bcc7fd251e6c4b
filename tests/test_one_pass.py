"""The one-pass host update (Note: [One-pass update] in offload/kernels/one_pass.py): PyTorch's fused
Adam/AdamW followed by a cast, bit for bit, in one pass over the masters."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.kernels import build
from offload.kernels.check import check_against_torch, same_bits
from offload.kernels.one_pass import SERVED, OnePassUpdate, one_pass

from .test_optimizer import assert_same, loss_of


@pytest.fixture(scope="module")
def kernel() -> types.ModuleType:
    module = build.host_kernel(wait=True)
    if module is None:
        pytest.fail(f"the one-pass kernel did not build here: {build.unavailable_reason()}")
    return module


_aten = torch.ops.aten
ADAMW, ADAM, SGD = _aten._fused_adamw_.default, _aten._fused_adam_.default, _aten._fused_sgd_.default
ADAM_DEFAULTS = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
                 "maximize": False, "grad_scale": None}
SGD_DEFAULTS = {"weight_decay": 0.0, "momentum": 0.9, "lr": 0.05, "dampening": 0.0, "nesterov": False,
                "maximize": False, "is_first_step": False, "grad_scale": None}

OPTIONS = [
    pytest.param(ADAMW, {}, id="AdamW"),
    pytest.param(ADAMW, {"weight_decay": 0.1}, id="AdamW-decay"),
    pytest.param(ADAM, {"weight_decay": 0.1}, id="Adam-L2"),
    pytest.param(ADAMW, {"amsgrad": True}, id="AdamW-amsgrad"),
    pytest.param(ADAM, {"maximize": True, "amsgrad": True}, id="Adam-maximize-amsgrad"),
    pytest.param(ADAMW, {"beta1": 0.2, "beta2": 0.9}, id="AdamW-small-beta1"),
    pytest.param(ADAMW, {"grad_scale": torch.tensor(1024.0)}, id="AdamW-grad-scale"),
    pytest.param(ADAM, {"lr": 0.5, "eps": 1e-3, "weight_decay": 0.3}, id="Adam-large-lr"),
    pytest.param(SGD, {}, id="SGD-momentum"),
    pytest.param(SGD, {"is_first_step": True, "nesterov": True}, id="SGD-nesterov-first-step"),
    pytest.param(SGD, {"nesterov": True, "weight_decay": 0.01, "maximize": True}, id="SGD-nesterov-decay-maximize"),
    pytest.param(SGD, {"momentum": 0.0, "grad_scale": torch.tensor(8.0)}, id="SGD-plain-grad-scale"),
    pytest.param(SGD, {"dampening": 0.3, "lr": 2.0}, id="SGD-dampening"),
]


def test_the_kernel_leaves_its_threads_count_as_it_found_it(kernel):
    """The kernel's first call on a thread must not set the thread's count to the one another
    thread stored last (the extension's own copy of PyTorch's first-use initialisation would):
    the thread's later kernels, a reduction's order with them, would change."""
    import threading
    seen: list[int] = []

    def run() -> None:
        torch.get_num_threads()  # PyTorch's first use on this thread, done
        torch.set_num_threads(3)
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start()
        other.join()
        n = 64 * kernel.vector_size() * 8  # several runs of pairs, so that it goes parallel
        given = [[torch.randn(n)], [torch.randn(n)], [torch.zeros(n)], [torch.zeros(n)], [], [torch.tensor(1.0)]]
        one_pass(kernel, ADAMW, given, [torch.empty(n, dtype=torch.bfloat16)], dict(ADAM_DEFAULTS))
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    torch.set_num_threads(before)
    assert seen == [3]


@pytest.mark.parametrize("op", [ADAMW, SGD], ids=["AdamW", "SGD"])
def test_the_kernel_lets_other_python_threads_run_while_it_works(kernel, op):
    """A slice's update runs on the update worker's thread while the thread that drives the device
    launches the backward's kernels from Python: the kernel must let go of Python's lock, or that
    thread stops for the whole update (a GPU trace showed a 12-15 ms stall in each slice's
    backward, one slice's update on the host). Here the main thread runs Python throughout calls
    on another thread, and the two threads' CPU times are compared: letting go, the main thread
    runs about as long as the kernel (a ratio near 1); holding the lock, it waits (0.1-0.3).
    CPU time, not wall time: other processes taking the cores away stop both threads' clocks,
    where they made a wall-clock pause look like a held lock."""
    import threading
    import time
    n = 1 << 24  # a call of tens of milliseconds, on one core
    given = ([[torch.randn(n)], [torch.randn(n)], [torch.zeros(n)], [torch.zeros(n)], [], [torch.tensor(1.0)]]
             if op is ADAMW else [[torch.randn(n)], [torch.randn(n)], [torch.zeros(n)]])
    options = dict(ADAM_DEFAULTS if op is ADAMW else SGD_DEFAULTS)
    shadows = [torch.empty(n, dtype=torch.bfloat16)]

    def main_over_kernel_cpu_time() -> float:
        kernel_time: list[float] = []

        def work() -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(1)  # the kernel on one core, the main thread on the other
            try:
                start = time.thread_time()
                for _ in range(3):
                    one_pass(kernel, op, given, shadows, dict(options))
                kernel_time.append(time.thread_time() - start)
            finally:
                torch.set_num_threads(before)  # the count new threads start with

        worker = threading.Thread(target=work)
        start = time.thread_time()
        worker.start()
        while worker.is_alive():
            pass  # Python's bytecode: it runs only while holding the lock
        main = time.thread_time() - start
        worker.join()
        assert len(kernel_time) == 1
        return main / kernel_time[0]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the lock passed between the threads at once, not after 5 ms
    try:
        ratios: list[float] = []
        while len(ratios) < 5 and not any(ratio > 0.5 for ratio in ratios):
            ratios.append(main_over_kernel_cpu_time())
    finally:
        sys.setswitchinterval(interval)
    assert any(ratio > 0.5 for ratio in ratios), \
        "the main thread ran " + ", ".join(f"{r:.2f}" for r in ratios) + " of the kernel's CPU time: it held the lock"


@pytest.mark.parametrize("op,changes", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "no-shadow"])
@pytest.mark.parametrize("clip", [None, 0.3712], ids=["", "clipped"])
def test_one_pass_equals_the_fused_kernel_then_a_cast(kernel, op, changes, dtype, clip):
    # Clipped: clip_grads_with_norm_'s grad.mul_(coefficient) before the fused kernel, against the
    # one pass multiplying each gradient as it reads it (and storing it so).
    width = kernel.vector_size()
    sizes = [1, width - 1, width, 3 * width + 5, 2053]
    generator = torch.Generator().manual_seed(len(changes))
    make = lambda spread: [torch.randn(n, generator=generator) * spread for n in sizes]  # noqa: E731
    params, grads = make(2.0), make(1.0)
    # Non-finite values in the vectors and in the tails; a parameter beyond the shadow's range.
    grads[-1][::101] = float("nan")
    grads[-1][3::67] = float("-inf")
    params[-2][::5] = float("inf")
    params[-1][1::13] = 3.0e38 if dtype == torch.bfloat16 else 7.0e4
    if op == SGD:
        options = {**SGD_DEFAULTS, **changes}
        given = [params, grads, make(0.1) if options["momentum"] else []]
    else:
        options = {**ADAM_DEFAULTS, **changes}
        exp_avg_sqs = [t.abs() for t in make(0.01)]
        given = [params, grads, make(0.1), exp_avg_sqs, [t * 2 for t in exp_avg_sqs] if options["amsgrad"] else [],
                 [torch.tensor(3.0) for _ in sizes]]
    expected = [[t.clone() for t in group] for group in given]
    coefficient = None if clip is None else torch.tensor(clip)
    if coefficient is not None:
        for grad in expected[1]:
            grad.mul_(coefficient)
    op(*expected, **options)
    # No shadow: an empty tensor (the update of a parameter without one, taken to multiply its gradient).
    shadows = [torch.full((n if dtype else 0,), 7.0, dtype=dtype or torch.bfloat16) for n in sizes]

    one_pass(kernel, op, given, shadows, options, coefficient)

    for mine, theirs in zip(given, expected):
        for a, b in zip(mine, theirs):
            assert same_bits(a, b)
    for shadow, param in zip(shadows, expected[0]):
        assert same_bits(shadow.float(), param.to(dtype).float()) if dtype else shadow.numel() == 0


def network() -> nn.Sequential:
    torch.manual_seed(0)
    frozen = nn.Linear(16, 16)
    frozen.requires_grad_(False)  # its shadow is the cast's, beside the updated ones
    # Sizes off the vector width, so that every tensor has a tail.
    return nn.Sequential(nn.Linear(6, 37), nn.Tanh(), nn.Linear(37, 16), nn.LayerNorm(16), frozen, nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("cls,kwargs", [
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, id="AdamW"),
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True, "maximize": True}, id="AdamW-amsgrad-maximize"),
    pytest.param(torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05}, id="Adam-L2"),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, id="SGD-nesterov"),
])
def test_offload_optimizer_steps_and_shadows_equal_the_fused_optimizer_and_a_cast(kernel, monkeypatch, cls, kwargs):
    served = []
    original = OnePassUpdate._serve

    def counting(self, func, args, kw):
        done = original(self, func, args, kw)
        served.append(done)
        return done

    monkeypatch.setattr(OnePassUpdate, "_serve", counting)
    plain_model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    plain = cls(plain_model.parameters(), fused=True, **kwargs)
    optimizer = OffloadOptimizer(model, cls, fused=True, **kwargs)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, optimizer)]
    for step in range(3):
        for m, o, schedule in zip((plain_model, model), (plain, optimizer), schedules):
            loss_of(m, step).backward()
            o.step()
            schedule.step()  # right after step(): the pending update keeps its learning rate
            o.zero_grad()
    assert served and all(served)
    assert_same(plain_model, plain, model, optimizer)
    # Each shadow is its slice's masters cast, the frozen layer's included; the plain model's
    # next forward casts its own, and the outputs agree.
    for s in model._engine.slices:
        storage = s.storage
        assert not storage.shadow_stale()
        for entry in storage.held:
            shadow = storage.transfer_source_of(entry.tensor)[0].view(entry.device_dtype)
            assert same_bits(shadow.float(), entry.tensor.detach().to(entry.device_dtype).float().view(-1))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(model(x), plain_model(x), rtol=0, atol=0)


class Perturbed:
    """The real kernels, with one element of one kernel's result moved by a unit in the last place."""

    def __init__(self, real: types.ModuleType, kernel: str, what: str) -> None:
        self.real, self.kernel, self.what = real, kernel, what
        self.vector_size = real.vector_size

    def adam_step(self, *args):
        self.real.adam_step(*args)
        if self.kernel == "adam":
            self._perturb(args[0], args[1], args[6], args[-1])

    def sgd_step(self, *args):
        self.real.sgd_step(*args)
        if self.kernel == "sgd":
            self._perturb(args[0], args[1], args[3], args[-1])

    def _perturb(self, params, grads, shadows, clip):
        # The third tensor: a whole vector of finite values in the check.
        if self.what == "clipped gradient":  # the gradient a clip's coefficient multiplied, as stored
            if clip is not None:
                grads[2][0:1] = torch.nextafter(grads[2][0:1], torch.full_like(grads[2][0:1], float("inf")))
            return
        target = params[2] if self.what == "parameter" else shadows[2]
        value = target[0:1].float()
        if self.what == "parameter":
            target[0:1] = torch.nextafter(value, torch.full_like(value, float("inf")))
        else:  # a unit in the shadow's last place, or more
            target[0:1] = (value + value.abs() * 0.01 + 1e-3).to(target.dtype)


@pytest.mark.parametrize("what", ["parameter", "shadow", "clipped gradient"])
@pytest.mark.parametrize("which", ["adam", "sgd"])
def test_the_check_refuses_a_kernel_that_differs_in_one_element(kernel, which, what):
    assert check_against_torch(kernel) is None
    mismatch = check_against_torch(Perturbed(kernel, which, what))
    assert mismatch is not None and which in mismatch
    assert ("clipped by" in mismatch and "argument 1" in mismatch) if what == "clipped gradient" else what in mismatch


def test_without_a_build_training_runs_pytorchs_kernels_and_says_why_once(monkeypatch, tmp_path):
    # No compiler, no build cached: the note names the compiler PyTorch's builder would run, not
    # ninja's last line ("build stopped: subcommand failed.").
    monkeypatch.setattr(build, "_state", {"module": None, "thread": None, "note": None,
                                          "exiting": False})
    missing = str(tmp_path / "no-such-c++")
    monkeypatch.setenv("CXX", missing)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.host_kernel(wait=True) is None
        assert build.host_kernel(wait=True) is None
    notes = [w for w in caught if issubclass(w.category, build.HostKernelUnavailable)]
    reason = f"RuntimeError: no C++ compiler ({missing}) found: install one, or name it in CXX"
    assert len(notes) == 1 and f"({reason})" in str(notes[0].message) and "same results" in str(notes[0].message)
    assert build.unavailable_reason() == reason
    served = []
    monkeypatch.setattr(OnePassUpdate, "_serve", lambda *args: served.append(1) or False)
    plain_model = OffloadModel(network(), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    model = OffloadModel(network(), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, fused=True)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(2):
        for m, o in ((plain_model, plain), (model, optimizer)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
    assert_same(plain_model, plain, model, optimizer)
    assert served == []


FAILED_BUILD = """Error building extension 'offload_one_pass_0123456789ab': [1/2] c++ -c one_pass.cpp -o one_pass.o
FAILED: one_pass.o
c++ -MMD -MF one_pass.o.d -O3 -c one_pass.cpp -o one_pass.o
%s
compilation terminated.
ninja: build stopped: subcommand failed.
"""


@pytest.mark.parametrize("cause", [
    "/bin/sh: 1: c++: not found",
    "one_pass.cpp:3:10: fatal error: ATen/cpu/vec/vec.h: No such file or directory",
    "one_pass.cpp:40:5: error: 'Vectorized' was not declared in this scope",
])
def test_a_failed_build_is_explained_by_the_line_that_names_its_cause(monkeypatch, cause):
    # PyTorch's message for a failed build ends with ninja's line, which names no cause.
    monkeypatch.setattr(build, "_state", {"module": None, "thread": None, "note": None, "exiting": False})

    def failed_build():
        raise RuntimeError(FAILED_BUILD % cause)

    monkeypatch.setattr(build, "_compile", failed_build)
    with pytest.warns(build.HostKernelUnavailable, match="with the same results"):
        assert build.host_kernel(wait=True) is None
    assert build.unavailable_reason() == f"RuntimeError: {cause}"


SECOND_INSTALL = """
import shutil, sys
from pathlib import Path
from offload.kernels import build

build.SOURCE = Path(shutil.copy(build.SOURCE, sys.argv[1]))  # the same source, installed elsewhere
print(build._compile().__file__, flush=True)
"""


def test_a_second_install_of_the_same_source_loads_the_first_ones_build(kernel, tmp_path):
    # Note: [One build per source] in offload/kernels/build.py: a second clone, worktree or CI
    # checkout sharing TORCH_EXTENSIONS_DIR used to recompile (35-80 s) on every switch, since
    # PyTorch's builder writes the source's path into the commands ninja compares.
    compiled = Path(kernel.__file__).with_name("one_pass.o")
    before = compiled.stat().st_mtime_ns
    done = subprocess.run([sys.executable, "-c", SECOND_INSTALL, str(tmp_path / "one_pass.cpp")],
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, f"{kernel.__file__}\n"), done.stderr[-2000:]
    assert compiled.stat().st_mtime_ns == before  # not compiled again


def test_the_environment_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("OFFLOAD_HOST_KERNELS", "0")
    assert build.host_kernel(wait=True) is None


def test_only_the_fused_kernels_are_served():
    assert set(SERVED) == {ADAMW, ADAM, SGD}


def test_a_lock_left_by_a_dead_build_is_cleared_under_the_builders_lock(tmp_path):
    # PyTorch's loader waits for ever on a `lock` file a killed build left behind; a fresh one,
    # with no live builder holding ours, is cleared; one a live builder may own is not.
    import subprocess
    import sys

    from offload.kernels import build

    left = tmp_path / "lock"
    left.write_text("")
    build._clear_left_lock(tmp_path, exclusive=False)
    assert left.exists()  # fresh, and without our lock: maybe a live build's
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"),
        str(tmp_path / "offload.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()  # a build killed while it held the lock: the kernel releases it
        holder.wait(timeout=10)
        with build._builders_lock(tmp_path) as exclusive:
            assert exclusive
            build._clear_left_lock(tmp_path, exclusive)
        assert not left.exists()
    finally:
        holder.kill()


EXIT_DURING_THE_BUILD = """
import sys, threading, time
from pathlib import Path
from offload.kernels import build

compile_for_real, built = build._compile, threading.Event()
build.EXIT_NOTE_SECONDS = float(sys.argv[3])

def compile_past_the_exit():
    built.set()
    while threading.main_thread().is_alive():  # until the script has ended
        time.sleep(0.001)
    module = compile_for_real()  # importing PyTorch's extension tools and loading the module, inside the exit
    time.sleep(float(sys.argv[2]))
    Path(sys.argv[1]).write_text("compiled")
    return module

build._compile = compile_past_the_exit
build.host_kernel()
built.wait()
print("exiting", flush=True)
"""

TRAINING_PAST_THE_MAIN_THREAD = """
import threading, time
from offload.kernels import build

def train():  # a thread that is no daemon goes on after the script's main thread ended
    time.sleep(0.3)
    print("built:", build.host_kernel(wait=True) is not None, build.unavailable_reason(), flush=True)

threading.Thread(target=train).start()
"""

A_BUILD_ASKED_FOR_AT_EXIT = """
import atexit
from offload.kernels import build

# Registered after the build's own handler, so it runs first, as an update worker's handler may.
atexit.register(lambda: print("build begun:", build.host_kernel() is not None or build._state["thread"] is not None))
"""

FIRST_UPDATE_AT_EXIT = """
import time
import torch
from torch import nn
from offload import OffloadModel, OffloadOptimizer
from offload.tiers import slice_update

step = slice_update.SliceStep._step

def late(self, *args, **kwargs):
    time.sleep(0.3)  # the worker reaches its first update after the script ended, in an exit handler
    result = step(self, *args, **kwargs)
    time.sleep(0.1)
    return result

slice_update.SliceStep._step = late
model = OffloadModel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(2)]), device="cpu", num_slices=1,
                     compute_dtype=torch.bfloat16)
optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
optimizer.step()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("slow, note_after", [(0.0, 60.0), (0.5, 0.05)])
def test_an_exit_during_the_build_waits_for_it_and_says_so_when_it_is_long(kernel, tmp_path, slow, note_after):
    # A daemon thread the interpreter stops inside C++ code aborts the process ("terminate called
    # without an active exception", status -6): importing PyTorch's extension tools, loading the
    # compiled module and the check can each be, so the exit waits for a build under way, whatever
    # it is doing (here the whole compile runs after the script ended), and says why past a while.
    marker = tmp_path / "compiled"
    done = subprocess.run([sys.executable, "-c", EXIT_DURING_THE_BUILD, str(marker), str(slow),
                           str(note_after)], capture_output=True,
                          text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "exiting\n"), done.stderr[-2000:]
    assert marker.read_text() == "compiled"
    assert ("waiting for the one-pass host kernel's build" in done.stderr) == (slow > 0), done.stderr[-2000:]


def test_an_exit_handler_asking_for_the_kernel_begins_no_build():
    # An update worker finishes the last step in an exit handler; a build begun then could run
    # into the interpreter's finalisation whichever handler ran first.
    env = {**os.environ, "OFFLOAD_HOST_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", A_BUILD_ASKED_FOR_AT_EXIT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert (done.returncode, done.stdout) == (0, "build begun: False\n"), done.stderr[-2000:]


def test_training_on_a_thread_that_outlives_the_main_one_builds_the_kernel(kernel):
    # The main thread has stopped, but the interpreter does not exit while such a thread runs.
    env = {**os.environ, "OFFLOAD_HOST_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", TRAINING_PAST_THE_MAIN_THREAD], capture_output=True, text=True,
                          timeout=300, env=env)
    assert (done.returncode, done.stdout) == (0, "built: True None\n"), done.stderr[-2000:]


def test_a_first_update_run_by_an_exit_handler_does_not_abort_the_process(kernel):
    # The update worker finishes its work in an exit handler; its first update asks for the kernel
    # then, which used to register the build's own exit handler too late to run (it aborted about
    # two runs in three).
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", FIRST_UPDATE_AT_EXIT], capture_output=True, text=True,
                              timeout=300)
        assert (done.returncode, done.stdout) == (0, "exiting\n"), done.stderr[-2000:]
