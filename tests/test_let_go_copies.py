"""A copy of an ``OffloadOptimizer`` whose model let go of a parameter after it was built: the copy
refuses to step the old tensor as the original does, and a copy made before the change steps the
new model's parameters (Note: [Parameters replaced after the optimizer], rule 4, in
``offload/optimizing/let_go.py``; Note: [Copying an OffloadOptimizer], rule 6, in
``offload/optimizing/copying.py``).

A tiny untied Llama through ``OffloadedCausalLM``, as in ``test_trl_more.py``.
"""

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload import OffloadOptimizer  # noqa: E402
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)
from .test_trainer import llama  # noqa: E402

REPLACED = (r"the model's parameters changed after this OffloadOptimizer was built: parameter 'weight' of a Linear "
            r"of shape \(64, 32\) in slice 1 was replaced.*Build the optimizer after changing the model")
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _saved_and_loaded(pair):
    buffer = io.BytesIO()
    torch.save({"model": pair[0], "optimizer": pair[1]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    return loaded["model"], loaded["optimizer"]


COPIES = {
    "deepcopy(optimizer)": lambda pair: (lambda o: (o.model, o))(copy.deepcopy(pair[1])),
    "deepcopy((model, optimizer))": copy.deepcopy,
    "torch.save/torch.load": _saved_and_loaded,
}


@pytest.mark.parametrize("how", list(COPIES))
def test_the_copy_of_an_optimizer_built_before_a_resize_refuses_to_step_the_old_lm_head(how):
    """resize_token_embeddings after the optimizer: its copy (alone, with the model, or pickled)
    holds a copy of the old lm_head weight outside the model's copy; its step() refuses, naming it,
    as the original's does, where it used to step that tensor and never train the new lm_head."""
    model = OffloadedCausalLM(llama(64), device="cpu", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model.resize_token_embeddings(80)
    model(input_ids=IDS, labels=IDS).loss.backward()
    copied_model, copied = COPIES[how]((model, optimizer))
    for p in copied_model.parameters():  # the optimizer's copy alone holds the OffloadModel: no HF call
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=REPLACED):
        copied.step()
    with pytest.raises(RuntimeError, match=REPLACED):
        optimizer.step()  # the original refuses still


def test_the_copy_of_an_optimizer_built_after_the_resize_trains_the_new_lm_head():
    """Built after the resize, the optimizer has nothing noted: its copy with the model steps the
    copy's new lm_head, bit for bit as the original steps its own."""
    model = OffloadedCausalLM(llama(64), device="cpu", num_slices=2)
    model.resize_token_embeddings(80)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    copied_model, copied = copy.deepcopy((model, optimizer))
    head = model.get_output_embeddings().weight.detach().clone()
    for m, o in ((model, optimizer), (copied_model, copied)):
        m(input_ids=IDS, labels=IDS).loss.backward()
        o.step()
        o.synchronize()
    assert not torch.equal(copied_model.get_output_embeddings().weight, head)
    assert torch.equal(copied_model.get_output_embeddings().weight, model.get_output_embeddings().weight)
