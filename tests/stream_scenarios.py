"""Training scenarios for the stream-ordering checker.

Each scenario builds its model with the ``build`` it is given (``OffloadModel`` on the CPU, with
keyword arguments), trains or evaluates it the way users do, and returns every tensor a user could
look at afterwards: outputs, losses, gradients, parameters, buffers. Run once with synchronous
copies and once under :class:`~offload.streamcheck.StreamChecker`, the two lists must be equal bit
for bit and the checker must find nothing.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import offload
from offload import OffloadActivations, OffloadModel, OffloadOptimizer

Build = Callable[..., OffloadModel]


class Fault(RuntimeError):
    """The stand-in for a device out-of-memory error."""


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Fault("out of memory in backward (simulated)")


class Faulty(nn.Module):
    """A linear layer that fails when armed: in forward, or in its backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_forward:
            raise Fault("out of memory in forward (simulated)")
        y = self.linear(x)
        return _FailInBackward.apply(y) if self.fail_backward else y


def mlp(width: int = 8, depth: int = 4, dropout: float = 0.0, norm: bool = False, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
        if norm:
            layers.append(nn.BatchNorm1d(width))
        if dropout:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers)


def state(model: nn.Module) -> list[torch.Tensor]:
    """Parameters, their gradients and buffers, as copies."""
    out = [t.detach().clone() for t in model.parameters()] + [t.detach().clone() for t in model.buffers()]
    out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out


def inputs(step: int, rows: int = 6, width: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, width, generator=generator)


def train(model: nn.Module, steps: int, optimizer: torch.optim.Optimizer | None = None,
          rows: int = 6) -> list[torch.Tensor]:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen: list[torch.Tensor] = []
    for step in range(steps):
        torch.manual_seed(step)
        optimizer.zero_grad(set_to_none=True)
        out = model(inputs(step, rows))
        loss = out.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        seen += [out.detach().clone(), loss.detach().clone()]
    return seen + state(model)


# -- the scenarios --------------------------------------------------------------------------------


def dropout_mlp(build: Build) -> list[torch.Tensor]:
    return train(build(mlp(dropout=0.2), num_slices=3), steps=3)


def batchnorm(build: Build) -> list[torch.Tensor]:
    return train(build(mlp(norm=True), num_slices=4), steps=3)


def batchnorm_microbatches(build: Build) -> list[torch.Tensor]:
    return train(build(mlp(norm=True), num_slices=4, num_microbatches=3), steps=2)


def in_place_first_layer(build: Build) -> list[torch.Tensor]:
    torch.manual_seed(0)
    slices = [nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)) for _ in range(4)]
    return train(build(slices), steps=2)


def microbatches(build: Build) -> list[torch.Tensor]:
    return train(build(mlp(dropout=0.1), num_slices=3, num_microbatches=3), steps=2)


def no_checkpointing(build: Build) -> list[torch.Tensor]:
    return train(build(mlp(dropout=0.1), num_slices=3, checkpoint_activation=False), steps=2)


def no_checkpointing_microbatches(build: Build) -> list[torch.Tensor]:
    return train(build(mlp(norm=True), num_slices=3, checkpoint_activation=False, num_microbatches=3), steps=2)


def bfloat16(build: Build) -> list[torch.Tensor]:
    model = build(mlp(norm=True), num_slices=3, compute_dtype=torch.bfloat16)
    return train(model, steps=3, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def adamw_steps(build: Build) -> list[torch.Tensor]:
    model = build(mlp(dropout=0.1), num_slices=4)
    return train(model, steps=4, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))


def two_forwards_one_backward(build: Build) -> list[torch.Tensor]:
    model = build(mlp(dropout=0.1), num_slices=3)
    first, second = model(inputs(0)), model(inputs(1))
    (first.pow(2).sum() + second.pow(3).sum()).backward()
    return [first.detach(), second.detach()] + state(model)


def retain_graph_twice(build: Build) -> list[torch.Tensor]:
    model = build(mlp(dropout=0.1), num_slices=3, num_microbatches=2)
    out = model(inputs(0))
    out.pow(2).sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    out.pow(2).sum().backward()
    return [out.detach()] + first + state(model)


def no_grad_between_steps(build: Build) -> list[torch.Tensor]:
    """Forwards without autograd, in eval mode and in train mode (running statistics change)."""
    model = build(mlp(norm=True, dropout=0.1), num_slices=3)
    seen = train(model, steps=1)
    with torch.no_grad():
        model.eval()
        seen.append(model(inputs(5)).clone())
        model.train()
        seen.append(model(inputs(6)).clone())
        seen += [b.clone() for b in model.buffers()]  # host state, right after the forward
    return seen + train(model, steps=1)


def forward_then_host_writes(build: Build) -> list[torch.Tensor]:
    """A forward without backward, then the host writes the parameters: an optimizer step on
    earlier gradients, a state dict, a direct copy; the next step must use the new values."""
    model = build(mlp(dropout=0.1), num_slices=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(inputs(0)).pow(2).sum().backward()
    saved = copy.deepcopy(model.state_dict())
    seen = [model(inputs(1)).detach().clone()]
    optimizer.step()
    seen.append(model(inputs(2)).detach().clone())
    model.load_state_dict(saved)
    with torch.no_grad():
        seen.append(model(inputs(3)).clone())
    optimizer.step()
    seen.append(model(inputs(4)).detach().clone())
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data * 0.5)
    return seen + train(model, steps=1)


def buffers_read_after_forward(build: Build) -> list[torch.Tensor]:
    model = build(mlp(norm=True), num_slices=4)
    out = model(inputs(0))
    stats = [b.clone() for b in model.buffers()]  # host state, right after forward
    out.pow(2).sum().backward()
    return [out.detach()] + stats + state(model)


class Counter(nn.Module):
    """A scale whose buffer changes in every forward. Its gradients and its buffers take the same
    number of bytes, so pooled host buffers pass from one use to the other."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.register_buffer("seen", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.detach().mean(0))
        return x * self.scale


def faults(build: Build, **kwargs: Any) -> list[torch.Tensor]:
    """A failure in forward and one in backward; after each the user reloads a checkpoint (host
    writes to the parameters) and trains on."""
    torch.manual_seed(0)
    layers = [Counter(8), nn.Linear(8, 8), nn.Tanh(), Faulty(8), nn.Tanh(), Counter(8), nn.Linear(8, 8), nn.Tanh(),
              nn.Linear(8, 3)]
    model = build(nn.Sequential(*layers), num_slices=5, **kwargs)
    faulty = model.get_submodule("3")
    seen = train(model, steps=1)
    for arm in ("fail_forward", "fail_backward"):
        saved = copy.deepcopy(model.state_dict())
        setattr(faulty, arm, True)
        try:
            model(inputs(7)).pow(2).sum().backward()
        except Fault:
            pass
        else:
            raise AssertionError("the armed layer did not fail")
        setattr(faulty, arm, False)
        model.load_state_dict(saved)
        seen += state(model) + train(model, steps=1)
    return seen


def frozen_first_slice(build: Build) -> list[torch.Tensor]:
    plain = mlp(dropout=0.1)
    for p in list(plain.parameters())[:4]:
        p.requires_grad_(False)
    model = build(plain, num_slices=3)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return train(model, steps=2, optimizer=optimizer)


def input_gradients_only(build: Build) -> list[torch.Tensor]:
    """``torch.autograd.grad`` with respect to the input: no parameter gradient leaves the device."""
    model = build(mlp(dropout=0.1), num_slices=3)
    x = inputs(0).requires_grad_()
    (grad,) = torch.autograd.grad(model(x).pow(2).sum(), x)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return [grad] + state(model) + train(model, steps=1)


def second_model_after_compute(build: Build) -> list[torch.Tensor]:
    """A model built after compute was queued: its fresh device slots may still be in use."""
    seen = train(build(mlp(seed=1), num_slices=2), steps=1)
    return seen + train(build(mlp(seed=2), num_slices=3), steps=1)


def offload_optimizer(build: Build) -> list[torch.Tensor]:
    """OffloadOptimizer: updates on a host worker, each slice's load waiting for its update."""
    model = build(mlp(dropout=0.1), num_slices=4)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    return train(model, steps=3, optimizer=optimizer)


def offload_optimizer_disk_tier(build: Build) -> list[torch.Tensor]:
    """OffloadOptimizer with its state on disk: each slice's read, update and write on three
    workers, five slices through a window of three buffers."""
    model = build(mlp(depth=5), num_slices=5)
    with tempfile.TemporaryDirectory() as directory:
        with OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=directory) as optimizer:
            seen = train(model, steps=3, optimizer=optimizer)
            saved = optimizer.state_dict()["state"]
    return seen + [t.clone() for k in sorted(saved) for t in saved[k].values()]


def offload_optimizer_masters_on_disk(build: Build) -> list[torch.Tensor]:
    """The masters in file mappings and the state on disk: each slice's masters read in and
    written back on two more workers around its update, five slices through a window of three;
    BatchNorm's running statistics, in the mappings too, written back through pinned memory."""
    with tempfile.TemporaryDirectory() as directory:
        model = build(mlp(depth=5, norm=True), num_slices=5, compute_dtype=torch.bfloat16, masters=directory)
        with OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=directory) as optimizer:
            seen = train(model, steps=3, optimizer=optimizer)
            optimizer.synchronize()
            seen += [t.detach().clone() for t in model.parameters()]
    return seen


def offload_optimizer_shadows_on_disk(build: Build) -> list[torch.Tensor]:
    """Masters on disk and no shadow kept (Note: [Shadows on disk]): each load casts its slice's
    masters into the next of two pinned staging buffers, which the load two before it read, ahead
    on a worker after the first load of a walk (the third slice's cast into the buffer the first
    slice's load of the same walk read); the head borrows the tied embedding, cast into a staging
    buffer of its own."""
    with tempfile.TemporaryDirectory() as directory:
        model = build(tied_mlp(), num_slices=4, compute_dtype=torch.bfloat16, masters=directory, shadows="disk")
        with OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=directory) as optimizer:
            seen = train(model, steps=3, optimizer=optimizer)
            optimizer.synchronize()
            seen += [t.detach().clone() for t in model.parameters()]
    return seen


def offload_optimizer_bfloat16(build: Build) -> list[torch.Tensor]:
    """The update writes each slice's bfloat16 shadow; the next forward loads it as it is."""
    model = build(mlp(norm=True), num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    return train(model, steps=3, optimizer=optimizer)


def offload_optimizer_after_forwards_without_backward(build: Build) -> list[torch.Tensor]:
    """Between backward and OffloadOptimizer.step(), a forward with autograd and one without whose
    loads read the host copies; the updates of the earlier gradients must come after them."""
    model = build(mlp(dropout=0.1), num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    seen: list[torch.Tensor] = []
    for step in range(2):
        torch.manual_seed(step)
        model(inputs(step)).float().pow(2).mean().backward()
        seen.append(model(inputs(10 + step)).detach().clone())
        with torch.no_grad():
            seen.append(model(inputs(20 + step)).clone())
        optimizer.step()
        optimizer.zero_grad()
    return seen + train(model, steps=1, optimizer=optimizer)


def detached_forward_then_buffer_snapshots(build: Build) -> list[torch.Tensor]:
    """``model(x).detach()``: the boundary activations' offloads are still running when their
    pooled buffers fall idle, and the next forward (in training mode, so it snapshots the
    BatchNorm buffers on the host into pooled buffers of the same size) writes one on the CPU.
    Width 2 and 32 rows a microbatch make a boundary activation as large as a slice's buffers."""
    model = build(mlp(width=2, norm=True), num_slices=3, num_microbatches=2)
    seen: list[torch.Tensor] = []
    for step in range(3):
        torch.manual_seed(step)
        model.train(step % 2 == 1)  # eval mode changes no buffer: the first forward takes no snapshot
        seen.append(model(inputs(step, rows=64, width=2)).detach().clone())
    return seen + state(model)


def reads_between_step_and_forward(build: Build) -> list[torch.Tensor]:
    """Code between step() and the next forward reads the parameters through the model and the
    optimizer, zeroes gradients in place (the next backward adds into them as slices land), and
    changes the learning rate."""
    model = build(mlp(dropout=0.1), num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=True)
    seen: list[torch.Tensor] = []
    for step in range(3):
        torch.manual_seed(step)
        model(inputs(step)).float().pow(2).mean().backward()
        optimizer.step()
        if step == 0:
            seen += [p.detach().clone() for p in model.parameters()]
        elif step == 1:
            seen += [v.clone() for v in model.state_dict().values()]
        else:
            saved = optimizer.state_dict()["state"]
            seen += [t.clone() for k in sorted(saved) for t in saved[k].values()]
        optimizer.param_groups[0]["lr"] *= 0.5
        optimizer.zero_grad(set_to_none=step != 1)
    return seen + state(model)


def data_parallel_one_rank(build: Build) -> list[torch.Tensor]:
    """Gradient averaging and a sharded update over a gloo group of one process: the collectives'
    worker waits for the gradients' offload, the next forward for the parameters' broadcast."""
    directory = tempfile.mkdtemp()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, "store"), 1), rank=0, world_size=1)
    try:
        model = build(mlp(dropout=0.1), num_slices=3, compute_dtype=torch.bfloat16, process_group=dist.group.WORLD)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, shard=True)
        seen = train(model, steps=2, optimizer=optimizer)
        with model.no_sync():
            model(inputs(5)).float().sum().backward()
        model(inputs(6)).float().sum().backward()
        return seen + state(model)
    finally:
        dist.destroy_process_group()


class _Lookup(nn.Module):
    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, x):
        return self.table((x.abs() * 3).long() % 11).mean(dim=1)


class Unembed(nn.Module):
    """The output projection by an embedding matrix itself (tied weights)."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, hidden):
        return hidden @ self.table.weight.t()


def tied_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    table = nn.Embedding(11, 8)
    return nn.Sequential(_Lookup(table), nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 8), Unembed(table))


def tied_across_slices(build: Build) -> list[torch.Tensor]:
    """An embedding tied to the output head: the last slice loads it from the first slice's host
    copy, after that slice's update, and a forward without backward is followed by host writes."""
    model = build(tied_mlp(), num_slices=3)
    seen = train(model, steps=2)
    seen.append(model(inputs(7)).detach().clone())
    with torch.no_grad():
        model.get_submodule("0").table.weight.mul_(0.5)
    return seen + train(model, steps=1)


def tied_across_slices_offload_optimizer(build: Build) -> list[torch.Tensor]:
    """The same under a compute dtype with OffloadOptimizer: the borrowed copy reads the holder's
    shadow, which the holder's update writes on the host worker."""
    model = build(tied_mlp(), num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    return train(model, steps=3, optimizer=optimizer)


def hugging_face_llama(build: Build) -> list[torch.Tensor]:
    """A Hugging Face Llama cut into stages, with OffloadOptimizer under a compute dtype: token ids,
    a padded 2-D mask, position ids, rotary tables and labels cross the boundaries, each slice
    builds its 4-D mask from the loaded ones, and the head computes the loss in checkpointed
    chunks (the second step) or from logits (the first)."""
    import transformers

    from offload.integrations.transformers import causal_lm_sequential

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=23, max_position_embeddings=16, attention_dropout=0.1,
        pad_token_id=0, bos_token_id=0, eos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    seen: list[torch.Tensor] = []
    for step, chunk in enumerate((None, 5)):
        layers = causal_lm_sequential(hf, loss_chunk_tokens=chunk)
        model = build(layers, num_slices=3, compute_dtype=torch.bfloat16)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        ids = torch.randint(1, 23, (3, 6), generator=torch.Generator().manual_seed(step))
        mask = torch.ones_like(ids)
        mask[0, 4:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        torch.manual_seed(step)
        if chunk is None:
            out = model({"input_ids": ids, "attention_mask": mask})
            loss = hf.loss_function(logits=out, labels=labels, vocab_size=23)
        else:
            out = model({"input_ids": ids, "attention_mask": mask, "labels": labels})
            loss = out.sum() / layers.count_loss_tokens(labels)
        loss.backward()
        optimizer.step()
        optimizer.synchronize()
        seen += [out.detach().clone(), loss.detach().clone()] + state(model)
    return seen


class _EveryOther(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., ::2]


def sparse_gradients_and_strided_boundaries(build: Build) -> list[torch.Tensor]:
    """A sparse embedding's gradients summed over microbatches and offloaded as indices and
    values, and a strided view crossing a checkpointed boundary (offloaded and loaded with its
    gaps)."""
    torch.manual_seed(0)
    slices = [nn.Sequential(nn.Embedding(20, 8, sparse=True), _EveryOther()), nn.Sequential(nn.GELU(), nn.Linear(4, 8)),
              nn.Linear(8, 3)]
    model = build(slices, num_microbatches=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    for step in range(2):
        optimizer.zero_grad()
        ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(step))
        out = model(ids)
        out.pow(2).mean().backward()
        seen += [out.detach().clone()] + [p.grad.to_dense() for p in model.parameters()]
        optimizer.step()
    return seen + [p.detach().clone() for p in model.parameters()]


def offloaded_activations(build: Build) -> list[torch.Tensor]:
    """Saved activations of the last slices to the host and back, beside recomputed slices, with
    microbatches and buffers that change (running statistics)."""
    model = build(mlp(norm=True, dropout=0.1), num_slices=4, num_microbatches=2,
                  offload_activations=OffloadActivations(last=3, min_bytes=0))
    return train(model, steps=3, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def offloaded_activations_retained(build: Build) -> list[torch.Tensor]:
    """Every slice offloaded, a graph differentiated twice (the second backward loads the saved
    tensors again), and a second forward whose offloads reuse the first one's pooled buffers."""
    model = build(mlp(dropout=0.1), num_slices=3, checkpoint_activation=False,
                  offload_activations=OffloadActivations(slices=[0, 1, 2], min_bytes=0))
    out = model(inputs(0))
    out.pow(2).sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    out.pow(2).sum().backward()
    return [out.detach()] + first + train(model, steps=2)


def faults_offloaded(build: Build) -> list[torch.Tensor]:
    """The failures of :func:`faults` with every slice's saved tensors offloaded: copies in flight
    when a forward or backward fails are drained, and the next steps reuse the pooled buffers."""
    return faults(build, offload_activations=OffloadActivations(last=5, min_bytes=0))


def update_in_backward(build: Build) -> list[torch.Tensor]:
    """OffloadOptimizer(update_in_backward=True) under a compute dtype: from the second step on,
    backward hands each slice's update to the host worker once its gradients are final on the
    host, and the next forward's loads wait for those updates. The second step's backward finds
    no ``.grad`` (autograd adopts the landed host copy: the update waits for its copy), the
    third's finds ``.grad`` zeroed in place (backward adds into it: the update waits for the
    addition)."""
    model = build(mlp(dropout=0.1), num_slices=4, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)
    return three_steps(model, optimizer, zeroed_in_place_after=1)


def three_steps(model: nn.Module, optimizer: torch.optim.Optimizer, zeroed_in_place_after: int,
                clip: float | None = None) -> list[torch.Tensor]:
    """Three steps, clipped by ``offload.clip_grad_norm_`` to ``clip`` if given, ``.grad`` zeroed in
    place after step ``zeroed_in_place_after`` and set to None after the others."""
    seen: list[torch.Tensor] = []
    for step in range(3):
        torch.manual_seed(step)
        out = model(inputs(step))
        loss = out.float().pow(2).mean()
        loss.backward()
        if clip is not None:
            seen.append(offload.clip_grad_norm_(model.parameters(), max_norm=clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=step != zeroed_in_place_after)
        seen += [out.detach().clone(), loss.detach().clone()]
    return seen + state(model)


def norms_in_backward(build: Build) -> list[torch.Tensor]:
    """OffloadOptimizer(norms_in_backward=True) under a compute dtype, clipped by
    offload.clip_grad_norm_: each slice's gradients have their norms taken on a host worker once
    they are final on the host (Note: [Norms from backward]), the clip waits for them; the second
    step's backward adds into .grad zeroed in place."""
    model = build(mlp(dropout=0.1), num_slices=4, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, norms_in_backward=True)
    return three_steps(model, optimizer, zeroed_in_place_after=0, clip=0.05)


def scale_in_update(build: Build) -> list[torch.Tensor]:
    """OffloadOptimizer(scale_in_update=True, norms_in_backward=True) under a compute dtype: each
    clip leaves each slice's scaling to the slice's update, which multiplies the gradients as it
    reads them (Note: [Scaling in the update]); the second step clips and steps twice (the second
    clip reads the gradients the first update wrote back scaled) and reads the gradients through
    the model between its second clip and step (the scaling then runs alone, after the first
    update); the third is never stepped (a GradScaler that found infinities), its scaling run
    alone when the next forward loads the slice."""
    model = build(mlp(dropout=0.1), num_slices=4, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, norms_in_backward=True,
                                 scale_in_update=True)
    params = list(model.parameters())
    seen: list[torch.Tensor] = []
    for step in range(4):
        torch.manual_seed(step)
        out = model(inputs(step))
        loss = out.float().pow(2).mean()
        loss.backward()
        seen.append(offload.clip_grad_norm_(params, max_norm=0.05))
        if step == 1:
            optimizer.step()
            seen.append(offload.clip_grad_norm_(params, max_norm=0.01))
            seen += [p.grad.clone() for p in model.parameters()]
        if step != 2:
            optimizer.step()
        optimizer.zero_grad(set_to_none=step != 0)
        seen += [out.detach().clone(), loss.detach().clone()]
    return seen + state(model)


def resident_slices(build: Build) -> list[torch.Tensor]:
    """The first two of four slices resident on the device (Note: [Resident slices]), with
    BatchNorm over two microbatches under a compute dtype, stepped by OffloadOptimizer: their loads,
    buffer write-backs and snapshots, gradients and updates run on the compute stream, beside the
    other slices' copies and host updates; the caller writes a resident weight between steps."""
    model = build(mlp(norm=True, dropout=0.1), num_slices=4, num_microbatches=2, compute_dtype=torch.bfloat16,
                  resident_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    seen = train(model, steps=2, optimizer=optimizer)
    with torch.no_grad():
        model.get_submodule("0").weight.mul_(0.5)
    return seen + train(model, steps=2, optimizer=optimizer)


def resident_tied_update_in_backward(build: Build) -> list[torch.Tensor]:
    """An embedding tied to the output head, held by a resident first slice: the last slice
    casts it from the device copy on the compute stream; under update_in_backward the streamed
    slices' updates start in backward while the resident one waits for step()."""
    model = build(tied_mlp(), num_slices=3, compute_dtype=torch.bfloat16, resident_slices=1)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)
    return train(model, steps=3, optimizer=optimizer)


def resident_tied_after_buffers(build: Build) -> list[torch.Tensor]:
    """An embedding held by the resident first slice and borrowed by the last, which takes the
    slot the second slice (BatchNorm: buffers written back from the slot) used: the borrowed copy,
    cast on the compute stream, lands on the bytes that write-back still reads."""
    torch.manual_seed(0)
    table = nn.Embedding(11, 8)
    slices = [nn.Sequential(_Lookup(table), nn.Linear(8, 8)),
              nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
              nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Unembed(table))]
    model = build(slices, resident_slices=1)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    return train(model, steps=3, optimizer=optimizer)


SCENARIOS: dict[str, Callable[[Build], list[torch.Tensor]]] = {
    f.__name__: f for f in (
        dropout_mlp, batchnorm, batchnorm_microbatches, in_place_first_layer, microbatches, no_checkpointing,
        no_checkpointing_microbatches, bfloat16, adamw_steps, two_forwards_one_backward, retain_graph_twice,
        no_grad_between_steps, forward_then_host_writes, buffers_read_after_forward, faults, frozen_first_slice,
        input_gradients_only, second_model_after_compute, offload_optimizer, offload_optimizer_disk_tier,
        offload_optimizer_masters_on_disk, offload_optimizer_shadows_on_disk, offload_optimizer_bfloat16,
        offload_optimizer_after_forwards_without_backward, detached_forward_then_buffer_snapshots,
        reads_between_step_and_forward, data_parallel_one_rank,
        tied_across_slices, tied_across_slices_offload_optimizer, sparse_gradients_and_strided_boundaries,
        offloaded_activations, offloaded_activations_retained, faults_offloaded, update_in_backward,
        norms_in_backward, scale_in_update, resident_slices, resident_tied_update_in_backward, resident_tied_after_buffers,
    )
}
try:
    import transformers  # noqa: F401  (the extra; without it the scenario is left out)
except ImportError:
    pass
else:
    SCENARIOS["hugging_face_llama"] = hugging_face_llama


def build_on_cpu(layers: Any, **kwargs: Any) -> OffloadModel:
    return OffloadModel(layers, device="cpu", **kwargs)
