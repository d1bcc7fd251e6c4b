"""A mixture of experts' load-balancing loss through the offloaded stages (Note: [Router logits] in
``offload/integrations/transformers_router.py``): the router logits, the aux loss and the loss with it
are the model's own, bit for bit in one microbatch, and so are the gradients that reach the routers;
families without such a loss stay refused, with what to do."""

from __future__ import annotations

import copy

import pytest
import torch

from offload import OffloadModel

from .helpers import ACTIVATIONS, assert_same_grads

transformers = pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[transformers]"')
from offload.integrations.transformers import OffloadedCausalLM, causal_lm_sequential  # noqa: E402
from offload.integrations.transformers_router import router_loss_of  # noqa: E402

from .test_transformers import EXACT, FAMILIES, LATER_FAMILIES, batch, build  # noqa: E402

#: The families whose model adds a load-balancing loss computed from its router logits.
ROUTED = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmoe", "granitemoe", "granitemoeshared", "phimoe",
          "jetmoe", "qwen3_next"]
#: Those among the later families (cut with a checked family's layout) that the installed release has.
LATER_ROUTED = [kind for kind in ("ernie4_5_moe", "flex_olmo", "flint") if kind in LATER_FAMILIES]


def routed(kind: str, coefficient: float = 0.25) -> torch.nn.Module:
    """A small model of ``kind`` asking for its router logits, with a coefficient large enough that the
    aux loss moves every gradient of the routers."""
    hf = build(kind)
    hf.config.output_router_logits = True
    hf.router_aux_loss_coef = coefficient  # what the forward reads (JetMoE's is aux_loss_coef)
    hf.aux_loss_coef = coefficient
    return hf


def labelled(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)


def both_backward(reference: torch.nn.Module, model: torch.nn.Module,
                  inputs: dict[str, torch.Tensor]) -> tuple:
    """The plain and the offloaded model's forward with labels and their backward, from the same random
    state; returns (offloaded output, plain output)."""
    torch.manual_seed(7)
    want = reference(**inputs, labels=labelled(inputs), use_cache=False)
    want.loss.backward()
    torch.manual_seed(7)
    got = model(**inputs, labels=labelled(inputs))
    got.loss.backward()
    return got, want


def test_the_families_with_a_router_loss_are_those_whose_stages_carry_router_logits():
    found = [kind for kind in FAMILIES + LATER_FAMILIES if router_loss_of(build(kind, layers=1)) is not None]
    assert found == ROUTED + LATER_ROUTED


CASES = [(kind, "recompute") for kind in ROUTED + LATER_ROUTED] + [
    ("mixtral", policy) for policy in ACTIVATIONS if policy != "recompute"]


@pytest.mark.parametrize(("kind", "activations"), CASES)
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
def test_loss_aux_loss_router_logits_and_gradients_are_the_models_bit_for_bit(kind, activations, masked):
    """Every family with the loss, and Mixtral under each activation policy (router logits passing
    through checkpointed, kept and offloaded slices)."""
    hf = routed(kind)
    reference = copy.deepcopy(hf)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=3, **ACTIVATIONS[activations])
    inputs = batch()
    labels = labelled(inputs)
    if not masked:
        inputs = {"input_ids": inputs["input_ids"]}
    for _ in range(2):  # the second step after an update of the host copies
        torch.manual_seed(7)
        want = reference(**inputs, labels=labels, use_cache=False)
        want.loss.backward()
        torch.manual_seed(7)
        got = model(**inputs, labels=labels)
        got.loss.backward()
        for name in ("loss", "aux_loss", "logits"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), **EXACT, msg=name)
        assert len(got.router_logits) == len(want.router_logits) > 0
        for g, w in zip(got.router_logits, want.router_logits):
            torch.testing.assert_close(g, w, **EXACT)
        assert_same_grads(hf, reference, **EXACT)
        with torch.no_grad():
            for p, q in zip(hf.parameters(), reference.parameters()):
                if p.grad is not None:  # ERNIE 4.5 MoE's unused expert bias has none, in both
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
                p.grad = q.grad = None


def test_the_call_decides_over_the_config_and_the_tuple_is_the_models():
    """``output_router_logits`` in the call wins over the config's, either way, as in the model; without
    labels there is an aux loss but no loss; ``return_dict=False`` gives the model's tuple."""
    hf = routed("mixtral")
    hf.config.output_router_logits = False
    reference = copy.deepcopy(hf).eval()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2).eval()
    inputs = batch()
    got = model(**inputs, output_router_logits=True)
    want = reference(**inputs, output_router_logits=True, use_cache=False)
    assert got.loss is None and want.loss is None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **EXACT)
    got_tuple = model(**inputs, labels=labelled(inputs), output_router_logits=True, return_dict=False)
    want_tuple = reference(**inputs, labels=labelled(inputs), output_router_logits=True, use_cache=False,
                           return_dict=False)
    assert len(got_tuple) == len(want_tuple) == 4  # loss, aux_loss, logits, router_logits
    for g, w in zip(got_tuple[:3], want_tuple[:3]):
        torch.testing.assert_close(g, w, **EXACT)
    hf.config.output_router_logits = reference.config.output_router_logits = True
    got = model(**inputs, labels=labelled(inputs), output_router_logits=False)
    want = reference(**inputs, labels=labelled(inputs), output_router_logits=False, use_cache=False)
    assert getattr(got, "aux_loss", None) is None and want.aux_loss is None
    torch.testing.assert_close(got.loss, want.loss, **EXACT)


def test_microbatches_join_the_router_logits_in_the_models_order():
    """Each microbatch's logits join along the batch, so the loss sees the model's rows in its order:
    equal to the float32 rounding of a router product over fewer rows."""
    hf = routed("qwen3_moe")
    reference = copy.deepcopy(hf)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=3, num_microbatches=2)
    got, want = both_backward(reference, model, batch())
    torch.testing.assert_close(got.aux_loss, want.aux_loss)
    torch.testing.assert_close(got.loss, want.loss)
    for g, w in zip(got.router_logits, want.router_logits, strict=True):
        torch.testing.assert_close(g, w)
    assert_same_grads(hf, reference, rtol=1e-5, atol=1e-6)


def test_a_loss_computed_in_the_head_adds_the_router_loss():
    hf = routed("olmoe")
    reference = copy.deepcopy(hf)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=3, loss_chunk_tokens=16)
    got, want = both_backward(reference, model, batch())
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **EXACT)
    torch.testing.assert_close(got.loss, want.loss)  # the chunked loss's float32 rounding (Note: [Chunked loss])
    assert_same_grads(hf, reference, rtol=1e-5, atol=1e-7)


def test_base_model_returns_the_router_logits_for_a_fused_head():
    """TRL's fused LM head asks the backbone for the router logits and computes the loss from them."""
    hf = routed("mixtral")
    hf.config.output_router_logits = False
    reference = copy.deepcopy(hf).eval()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2).eval()
    inputs = batch()
    got = model.base_model(**inputs, output_router_logits=True)
    want = reference.model(**inputs, output_router_logits=True, use_cache=False)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **EXACT)
    for g, w in zip(got.router_logits, want.router_logits, strict=True):
        torch.testing.assert_close(g, w, **EXACT)
    assert getattr(model.base_model(**inputs), "router_logits", None) is None


def test_the_stages_carry_router_logits_when_cut_to_and_asked():
    hf = routed("mixtral")
    reference = copy.deepcopy(hf).eval()
    with pytest.raises(ValueError, match=r"load-balancing term.*router_logits=True.*OffloadedCausalLM"):
        causal_lm_sequential(hf)
    layers = causal_lm_sequential(hf, router_logits=True)
    model = OffloadModel(layers, device="cpu", num_slices=2).eval()
    inputs = batch()
    logits = model(inputs)  # not asked: the logits alone
    assert isinstance(logits, torch.Tensor)
    logits, *carried = model({**inputs, "output_router_logits": True})
    want = reference(**inputs, use_cache=False)
    torch.testing.assert_close(logits, want.logits, **EXACT)
    flat = tuple(r.reshape(-1, r.shape[-1]) for r in carried)
    for g, w in zip(flat, want.router_logits, strict=True):
        torch.testing.assert_close(g, w, **EXACT)
    hf.config.output_router_logits = False
    plain = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)
    with pytest.raises(TypeError, match=r"not cut to carry: causal_lm_sequential\(model, router_logits=True\)"):
        plain({**inputs, "output_router_logits": True})


@pytest.mark.parametrize("kind", ["llama4_text", "llama"])
def test_families_without_a_router_loss_are_refused(kind):
    hf = build(kind, layers=1)
    with pytest.raises(ValueError, match="computes no load-balancing loss"):
        causal_lm_sequential(hf, router_logits=True)


def test_a_model_with_routers_but_no_loss_refuses_the_call_asking_for_its_logits():
    model = OffloadedCausalLM(build("llama4_text", layers=1), device="cpu", num_slices=1)
    with pytest.raises(TypeError, match=r"cannot add this mixture of experts' load-balancing loss "
                                        r"\(output_router_logits=True in the call\).*router_aux_loss_coef=0\.0"):
        model(**batch(), output_router_logits=True)


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3", "llama4_text"])
def test_a_config_asking_for_router_logits_of_a_family_without_the_loss_is_refused_as_such(kind):
    """The model's loss is the same with or without ``output_router_logits`` (it adds no term): the cut
    says so, and that turning it off is the way, not a ``router_logits=True`` that it refuses next."""
    hf = build(kind, layers=1)
    inputs = batch()
    torch.manual_seed(7)
    plain = hf(**inputs, labels=labelled(inputs), use_cache=False)
    hf.config.output_router_logits = True
    torch.manual_seed(7)
    asked = hf(**inputs, labels=labelled(inputs), use_cache=False)
    assert getattr(asked, "aux_loss", None) is None
    torch.testing.assert_close(asked.loss, plain.loss, **EXACT)
    message = (r"with output_router_logits=True: this model adds no load-balancing term to its loss.*"
               r"output_router_logits = False.*the loss is the same$")
    for cut in (lambda: causal_lm_sequential(hf), lambda: OffloadedCausalLM(hf, device="cpu", num_slices=1)):
        with pytest.raises(ValueError, match=message):
            cut()


def test_a_family_whose_loss_the_stages_cannot_carry_is_told_to_turn_it_off(monkeypatch):
    hf = routed("mixtral")
    monkeypatch.setattr(hf, "router_aux_loss_coef", None)  # no coefficient: router_loss_of finds no loss
    with pytest.raises(ValueError, match=r"which the stages cannot carry for it.*output_router_logits = False"):
        OffloadedCausalLM(hf, device="cpu", num_slices=1)


def test_a_model_without_routers_ignores_the_keyword_as_the_model_does():
    """A dense model's forward takes ``output_router_logits=True`` and returns what it returns without it."""
    reference = build("llama", dropout=0.0)
    model = OffloadedCausalLM(copy.deepcopy(reference), device="cpu", num_slices=2)
    inputs = batch()
    want = reference(**inputs, labels=labelled(inputs), use_cache=False, output_router_logits=True)
    got = model(**inputs, labels=labelled(inputs), output_router_logits=True)
    assert type(got) is type(want)
    torch.testing.assert_close((got.loss, got.logits), (want.loss, want.logits), **EXACT)
    hidden = model.base_model(**inputs, output_router_logits=True)
    want_hidden = reference.model(**inputs, use_cache=False, output_router_logits=True)
    assert type(hidden) is type(want_hidden)
    torch.testing.assert_close(hidden.last_hidden_state, want_hidden.last_hidden_state, **EXACT)


def test_the_call_can_turn_off_what_the_config_asks_of_a_family_without_the_loss():
    hf = build("llama4_text", layers=1)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=1)
    hf.config.output_router_logits = True  # set after wrapping, as TRL's trainers do
    inputs = batch()
    with pytest.raises(TypeError, match=r"\(output_router_logits=True in the model's config\)"):
        model(**inputs)
    assert model(**inputs, output_router_logits=False).logits.shape[:2] == inputs["input_ids"].shape


def test_a_batch_asking_with_anything_but_a_bool_is_refused():
    layers = causal_lm_sequential(routed("mixtral"), router_logits=True)
    model = OffloadModel(layers, device="cpu", num_slices=2)
    for value in (1, torch.tensor(True), "yes"):
        with pytest.raises(TypeError, match="'output_router_logits' must be True or False"):
            model({**batch(), "output_router_logits": value})


def test_stages_cut_again_from_one_model_leave_no_hooks_behind():
    """Each cut's hooks hold its stages weakly and go with them: a model wrapped again and again
    (a second OffloadedCausalLM, a notebook's cell run twice) runs one hook per router."""
    import gc

    hf = routed("mixtral")
    routers = [m for m in hf.modules() if type(m).__name__ == "MixtralTopKRouter"]
    for _ in range(3):
        model = OffloadedCausalLM(hf, device="cpu", num_slices=2)
        model(**batch())
        assert [len(r._forward_hooks) for r in routers] == [1] * len(routers)
        del model
        gc.collect()
    assert [len(r._forward_hooks) for r in routers] == [0] * len(routers)


def test_each_routers_logits_go_to_the_host_once_not_at_every_later_boundary(monkeypatch):
    """The logits cross every later slice to the head, entering each through a copy (they need a
    gradient); a copy passed on unchanged shares the saved leaf of what it copies (Note: [Leaves that
    pass through] in offload/autograd/records.py), so L layers offload L tensors of logits, not
    L(L-1)/2, and the result stays the model's."""
    from offload.streams.activations import ActivationOffloader

    offloaded: list[tuple[int, ...]] = []
    offload = ActivationOffloader.offload

    def counted(self, tensor):
        offloaded.append(tuple(tensor.shape))
        return offload(self, tensor)

    monkeypatch.setattr(ActivationOffloader, "offload", counted)
    layers = 6
    hf = build("mixtral", layers=layers)
    hf.config.output_router_logits = True
    reference = copy.deepcopy(hf)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=layers + 2)  # one decoder layer a slice
    inputs = batch()
    torch.manual_seed(7)
    got = model(**inputs, labels=labelled(inputs))
    got.loss.backward()
    router_shape = (*inputs["input_ids"].shape, hf.config.num_local_experts)
    assert 0 < offloaded.count(router_shape) <= layers
    torch.manual_seed(7)
    want = reference(**inputs, labels=labelled(inputs), use_cache=False)
    want.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, **EXACT)
    assert_same_grads(hf, reference, **EXACT)
