"""One model from two threads: a second walk while one runs is refused in its own thread, before it
touches anything, and the running walk trains on exactly as the plain model (Note: [One walk at a
time] in ``offload/walk/slice_walk.py``). Training from one thread, the main one or another, and
use from two threads one after the other stay exact.

Each concurrent case is made deterministic by a layer that, once armed, signals that the first
thread's walk is inside it and waits there until the second thread's call has returned or raised.
Every thread is joined with a timeout.
"""

import threading
import types

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

TIMEOUT = 30  # seconds for any one thread; a run here takes well under one


class Gate(nn.Module):
    """The identity; armed, it stops the run that reaches it (the ``stop_at``-th call from arming,
    counting forward and recompute alike) until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        # Not a plain attribute: a recompute runs with those its forward run started with (a
        # list's shallow copy too: Note: [Attribute state]).
        self.calls_left = types.SimpleNamespace(count=0)

    def arm(self, stop_at: int = 1) -> None:
        self.entered.clear()
        self.release.clear()
        self.calls_left.count = stop_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls_left.count > 0:
            self.calls_left.count -= 1
            if self.calls_left.count == 0:
                self.entered.set()
                assert self.release.wait(TIMEOUT), "the test never released the gate"
        return x


def _layers(seed: int = 0) -> nn.Sequential:
    # The gate first, so that it is in slice 0, which backward recomputes.
    torch.manual_seed(seed)
    return nn.Sequential(Gate(), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _pair():
    plain = _layers()
    model = OffloadModel(_layers(), device="cpu", num_slices=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    opt = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    return plain, plain_opt, model, opt


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


EVAL_INPUT = torch.randn(7, 6, generator=torch.Generator().manual_seed(99))


def _step(model, opt, x) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _assert_same(plain, model, opt) -> None:
    opt.synchronize()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


def _in_thread(target, name: str) -> dict:
    """Run ``target`` in a new thread; what it returned or raised lands in the dict once joined."""
    done: dict = {}

    def run():
        try:
            done["value"] = target()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            done["error"] = error

    thread = threading.Thread(target=run, name=name, daemon=True)
    done["thread"] = thread
    thread.start()
    return done


def _join(done: dict) -> None:
    done["thread"].join(TIMEOUT)
    assert not done["thread"].is_alive(), f"thread {done['thread'].name} did not finish in {TIMEOUT} s"


def _watch_engine(monkeypatch, engine) -> list[tuple[str, str]]:
    """(what, thread name) for every touch of the engine's state a call makes before its walk's
    first slice: the refresh's look at the layers, the forward's milestones, the slots."""
    touched: list[tuple[str, str]] = []

    def spy(owner, name):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            touched.append((name, threading.current_thread().name))
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapped)

    for s in engine.slices:
        spy(s.storage, "registered_tensors_changed")
    spy(engine.milestones, "forward_started")
    spy(engine.milestones, "backward_started")
    spy(engine.slots, "forget_contents")
    spy(engine.slots, "acquire")
    return touched


def _refused(done: dict, what: str, holder: str) -> None:
    error = done.get("error")
    assert isinstance(error, RuntimeError), done
    message = str(error)
    assert message.startswith(f"OffloadModel: {what} from another thread (thread '{done['thread'].name}') while "
                              f"thread '{holder}' runs a walk of this model"), message
    assert "one thread at a time" in message and "copy.deepcopy" in message


def _trainer_goes_on_exact(gate, trainer, plain, plain_opt, model, opt) -> None:
    """Lets the trainer blocked at ``gate`` go on: its step equals the plain model's, bit for bit."""
    gate.release.set()
    _join(trainer)
    assert "error" not in trainer, trainer.get("error")
    assert torch.equal(trainer["value"], _step(plain, plain_opt, _batch(0)))
    _assert_same(plain, model, opt)


@pytest.mark.parametrize("blocked_in", ["forward", "backward"])
def test_an_eval_forward_from_another_thread_is_refused_and_training_stays_exact(monkeypatch, blocked_in):
    plain, plain_opt, model, opt = _pair()
    gate = model[0]
    touched = _watch_engine(monkeypatch, engine_of(model))
    # Stopped in forward's run of slice 0, or in backward's recompute of it (its second call).
    gate.arm(stop_at=1 if blocked_in == "forward" else 2)
    trainer = _in_thread(lambda: _step(model, opt, _batch(0)), "trainer")
    assert gate.entered.wait(TIMEOUT)

    def evaluate():
        touched.append(("eval starts", threading.current_thread().name))
        with torch.no_grad():
            return model(EVAL_INPUT)
    evaluator = _in_thread(evaluate, "evaluator")
    _join(evaluator)
    _trainer_goes_on_exact(gate, trainer, plain, plain_opt, model, opt)
    _refused(evaluator, "a forward (or a move, .to())", "trainer")
    assert [who for _, who in touched].count("evaluator") == 1  # only the marker: nothing of the engine's
    for s in range(1, 4):  # and on: nothing the refused call could have left behind
        assert torch.equal(_step(model, opt, _batch(s)), _step(plain, plain_opt, _batch(s)))
    _assert_same(plain, model, opt)
    with torch.no_grad():
        assert torch.equal(model(EVAL_INPUT), plain(EVAL_INPUT))


def test_two_eval_threads_the_second_is_refused_and_the_first_gets_the_plain_output(monkeypatch):
    plain, _, model, _ = _pair()
    gate = model[0]
    touched = _watch_engine(monkeypatch, engine_of(model))
    gate.arm()

    def evaluate():
        touched.append(("eval starts", threading.current_thread().name))
        with torch.no_grad():
            return model(EVAL_INPUT)
    first = _in_thread(evaluate, "first")
    assert gate.entered.wait(TIMEOUT)
    second = _in_thread(evaluate, "second")
    _join(second)
    gate.release.set()
    _join(first)

    with torch.no_grad():
        expected = plain(EVAL_INPUT)
    assert torch.equal(first["value"], expected)
    _refused(second, "a forward (or a move, .to())", "first")
    assert [who for _, who in touched].count("second") == 1
    with torch.no_grad():
        assert torch.equal(model(EVAL_INPUT), expected)  # the refused thread's next call, here, works


def test_a_forward_with_autograd_claims_before_its_records_and_milestones(monkeypatch):
    # The refresh claims first on every call; past it (a walk starting between the two), the
    # Function's own claim refuses before the forward's milestones, records or slots.
    plain, plain_opt, model, opt = _pair()
    engine = engine_of(model)
    gate = model[0]
    gate.arm()
    trainer = _in_thread(lambda: _step(model, opt, _batch(0)), "trainer")
    assert gate.entered.wait(TIMEOUT)
    monkeypatch.setattr(engine, "refresh", lambda: None)
    touched = _watch_engine(monkeypatch, engine)
    caller = _in_thread(lambda: model(EVAL_INPUT), "caller")
    _join(caller)
    _trainer_goes_on_exact(gate, trainer, plain, plain_opt, model, opt)
    _refused(caller, "a forward", "trainer")
    assert [what for what, who in touched if who == "caller"] == []


def test_a_backward_from_another_thread_is_refused_while_a_walk_runs(monkeypatch):
    plain, plain_opt, model, opt = _pair()
    engine = engine_of(model)
    # A graph of the other thread's, made before the trainer's walk starts.
    other_loss = model(EVAL_INPUT).pow(2).mean()
    gate = model[0]
    gate.arm()
    trainer = _in_thread(lambda: _step(model, opt, _batch(0)), "trainer")
    assert gate.entered.wait(TIMEOUT)
    touched = _watch_engine(monkeypatch, engine)
    backward = _in_thread(lambda: other_loss.backward(), "other")
    _join(backward)
    gate.release.set()
    _join(trainer)

    assert "error" not in trainer, trainer.get("error")
    # The plain twin: the other thread's forward ran, its backward never did.
    plain(EVAL_INPUT)
    assert torch.equal(trainer["value"], _step(plain, plain_opt, _batch(0)))
    _assert_same(plain, model, opt)
    _refused(backward, "a backward", "trainer")
    assert [what for what, who in touched if who == "other"] == []


def test_training_in_a_background_thread_is_exact():
    plain, plain_opt, model, opt = _pair()
    trainer = _in_thread(lambda: [_step(model, opt, _batch(s)) for s in range(4)], "trainer")
    _join(trainer)
    assert "error" not in trainer, trainer.get("error")
    assert all(torch.equal(a, _step(plain, plain_opt, _batch(s))) for s, a in enumerate(trainer["value"]))
    _assert_same(plain, model, opt)
    # And on in the main thread.
    assert torch.equal(_step(model, opt, _batch(4)), _step(plain, plain_opt, _batch(4)))
    _assert_same(plain, model, opt)


def test_forward_in_one_thread_and_backward_in_another_is_exact():
    # As autograd does on a GPU: backward on its device's thread, after the forward returned.
    plain, plain_opt, model, opt = _pair()
    for s in range(3):
        opt.zero_grad()
        forward = _in_thread(lambda: model(_batch(s)).pow(2).mean(), "forward")
        _join(forward)
        backward = _in_thread(lambda: forward["value"].backward(), "backward")
        _join(backward)
        assert "error" not in backward, backward.get("error")
        opt.step()
        expected = _step(plain, plain_opt, _batch(s))
        assert torch.equal(forward["value"].detach(), expected)
    _assert_same(plain, model, opt)


def test_two_threads_one_after_the_other_train_and_evaluate_exactly():
    plain, plain_opt, model, opt = _pair()
    for s in range(4):
        trainer = _in_thread(lambda: _step(model, opt, _batch(s)), f"trainer {s}")
        _join(trainer)
        evaluator = _in_thread(lambda: model(EVAL_INPUT).detach(), f"evaluator {s}")
        _join(evaluator)
        assert "error" not in trainer and "error" not in evaluator, (trainer, evaluator)
        assert torch.equal(trainer["value"], _step(plain, plain_opt, _batch(s)))
        assert torch.equal(evaluator["value"], plain(EVAL_INPUT).detach())
    _assert_same(plain, model, opt)


def test_an_interrupt_as_an_evaluation_walk_starts_gives_the_claim_up(monkeypatch):
    """Ctrl-C as a forward without autograd enters its walk (the walk's claim is the only one):
    the claim is given up, so a backward on another thread (a CUDA device's) is not refused later."""
    plain, plain_opt, model, opt = _pair()
    engine = engine_of(model)
    forget = type(engine.slots).forget_contents

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(engine.slots), "forget_contents", interrupted)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(EVAL_INPUT)
    monkeypatch.setattr(type(engine.slots), "forget_contents", forget)
    assert engine.walking is None
    forward = model(_batch(0)).pow(2).mean()
    backward = _in_thread(lambda: forward.backward(), "backward")
    _join(backward)
    assert "error" not in backward, backward.get("error")
    opt.step()
    _step(plain, plain_opt, _batch(0))
    _assert_same(plain, model, opt)
