"""Ready-made models with their inputs and loss, for scripts that measure OffloadModel.

A :class:`Preset` bundles a freshly built ``nn.Sequential`` (on the CPU), a function that makes a
batch for it, and the loss to train it with, so a profiling or benchmark script can run any of
them the same way. :func:`build_preset` builds the named ones (``tiny``, ``mlp``,
``transformer``) with sizes that can be overridden; :func:`preset_from_factory` wraps a user's
own ``package.module:factory``.

This module holds model definitions only: nothing here measures, moves models to a device or
wraps them in :class:`~offload.OffloadModel`. It is not exported from ``offload``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

#: (input, target) for one step; ``target`` is whatever the preset's ``loss`` expects.
Batch = tuple[Any, Any]
#: The largest size a setting takes: torch's sizes are int64, and a larger one fails in its C++,
#: with that code's frames in the message.
MAX_SIZE = 2**63 - 1


@dataclass(frozen=True)
class Preset:
    """A model, how to make its input, and how to turn its output into a loss.

    Attributes:
        name: the preset's name (``"custom"`` for :func:`preset_from_factory`).
        description: one line saying what the model is, with its sizes.
        model: the ``nn.Sequential``, freshly built on the CPU with a fixed seed: two builds with
            the same settings hold the same weights.
        make_batch: ``make_batch(batch_size, device) -> (input, target)``. The same arguments
            always give the same batch, so several runs can be compared on one input.
        loss: ``loss(output, target) -> scalar tensor``.
        batch_size: a batch size that suits the model's size.
        settings: the sizes the model was built with, defaults included.
    """

    name: str
    description: str
    model: nn.Sequential
    make_batch: Callable[[int, torch.device | str], Batch]
    loss: Callable[[Any, Any], torch.Tensor]
    batch_size: int
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def preset_names() -> list[str]:
    """Names :func:`build_preset` accepts."""
    return list(_BUILDERS)


def build_preset(name: str, **overrides: Any) -> Preset:
    """Build the preset ``name``, with any of its settings overridden.

    Args:
        name: ``"tiny"``, ``"mlp"`` or ``"transformer"``.
        **overrides: settings of that preset (see :func:`preset_settings`), e.g.
            ``n_layers=24, d_model=2048`` for a larger transformer. Every preset takes ``seed``
            (the weights) and ``batch_size`` (the suggested batch size).

    Raises:
        ValueError: an unknown preset name, an unknown setting, or a setting out of range.

    Example::

        >>> preset = build_preset("transformer", n_layers=2, d_model=128)
        >>> x, y = preset.make_batch(4, "cpu")
        >>> preset.loss(preset.model(x), y).backward()
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(_BUILDERS)}")
    known = preset_settings(name)
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(
            f"preset {name!r} has no setting {', '.join(map(repr, unknown))}; its settings are {', '.join(known)}"
        )
    settings = known | overrides
    _check_settings(name, settings)
    with torch.random.fork_rng(devices=[]):
        # A fixed seed so that every build of the same settings holds the same weights, without
        # disturbing the caller's random stream.
        torch.manual_seed(settings["seed"])
        return builder(**settings)


def _check_settings(name: str, settings: dict[str, Any]) -> None:
    for key, value in settings.items():
        if key == "dropout":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"preset {name!r}: dropout must be a number in [0, 1), got {value!r}")
            continue
        lowest = 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= MAX_SIZE:
            raise ValueError(f"preset {name!r}: {key} must be an int of at least {lowest} (and at most 2**63-1), "
                             f"got {value!r}")


def preset_settings(name: str) -> dict[str, Any]:
    """The settings of preset ``name`` and their defaults."""
    builder = _BUILDERS[name]
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()}


def preset_from_factory(spec: str, input_shape: Sequence[int], vocab: int | None = None, seed: int = 0,
                        batch_size: int = 8) -> Preset:
    """Wrap ``package.module:factory`` (a function returning an ``nn.Sequential``) as a preset.

    The input is random: floats of shape ``(batch_size, *input_shape)``, or, with ``vocab``,
    integer token ids in ``[0, vocab)``. The loss is the mean of the squared output, which
    exercises every gradient without knowing what the model predicts.

    Args:
        spec: ``"package.module:factory"``; ``factory()`` is called with no arguments, under
            ``torch.manual_seed(seed)``.
        input_shape: shape of one sample, without the batch dimension.
        vocab: make token ids below this instead of floats.

    Raises:
        ValueError: a malformed spec, a module that cannot be imported (or is not valid Python), a
            missing or non-callable factory, a factory that raised, a bad shape, a model
            without parameters or with every parameter frozen, or a ``vocab`` past the rows of
            its first ``nn.Embedding``.
        TypeError: the factory returned something other than an ``nn.Sequential``.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model must look like package.module:factory, got {spec!r}")
    if "/" in module_name or module_name.endswith(".py"):
        name = module_name.rsplit("/", 1)[-1].removesuffix(".py")
        raise ValueError(f"--model takes a module's name, not a file's path: for {module_name}, run from its "
                         f"directory and give --model {name}:{attribute}")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as error:  # a module that is not there, or not Python
        raise ValueError(f"cannot import {module_name!r} for --model {spec}: {error}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attribute!r} for --model {spec}")
    shape = tuple(input_shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"the input shape must be positive ints, got {shape!r}")
    if vocab is not None and vocab < 1:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory()
        except Exception as error:  # the user's code: one line that names it, not a traceback into ours
            first = (str(error).strip().splitlines() or [""])[0]
            raise ValueError(f"--model {spec}: the factory raised {type(error).__name__}"
                             f"{': ' + first if first else ''}") from error
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"{spec} returned a {type(model).__name__}; it must return an nn.Sequential")
    _check_model(model, spec, vocab)

    def make_batch(rows: int, device: torch.device | str) -> Batch:
        generator = _generator(seed)
        if vocab is not None:
            x = torch.randint(0, vocab, (rows, *shape), generator=generator)
        else:
            x = torch.randn((rows, *shape), generator=generator)
        return x.to(device), None

    kind = f"token ids below {vocab}" if vocab is not None else "float32"
    return Preset(
        name="custom",
        description=f"{spec}: {len(model)} layers, input (batch, {', '.join(map(str, shape))}) {kind}",
        model=model,
        make_batch=make_batch,
        loss=_mean_square,
        batch_size=batch_size,
        settings={"model": spec, "input_shape": list(shape), "vocab": vocab, "seed": seed},
    )


def check_trainable(model: nn.Module, returned: str) -> None:
    """Refuse a model without parameters, or whose parameters are all frozen: with nothing that
    requires a gradient, the loss has no ``grad_fn`` and the first ``backward()`` fails inside
    autograd ("element 0 of tensors does not require grad") once a mode has started.

    Args:
        returned: how the message names where the model came from, e.g. ``"pkg.models:build returned"``.

    Raises:
        ValueError: saying what to change.
    """
    parameters = list(model.parameters())
    if not parameters:
        raise ValueError(f"{returned} an nn.Sequential without parameters: there is nothing to offload or "
                         "train; return the layers with their weights")
    if not any(p.requires_grad for p in parameters):
        raise ValueError(f"{returned} an nn.Sequential whose {len(parameters)} parameters are all frozen "
                         "(requires_grad=False): there is nothing to train; unfreeze the ones to train "
                         "(requires_grad_(True)) before returning it")


def _check_model(model: nn.Sequential, spec: str, vocab: int | None) -> None:
    """Refuse a factory's model without parameters to train (:func:`check_trainable`), or with
    fewer rows in its first ``nn.Embedding`` (which takes the token ids) than ``vocab``: a real
    forward would index past its table (``IndexError``), where the planner's fake tensors read no
    index."""
    check_trainable(model, f"{spec} returned")
    name, embedding = next(((name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)),
                           (None, None))
    if vocab is not None and embedding is not None and vocab > embedding.num_embeddings:
        raise ValueError(f"--vocab {vocab} is more than the {embedding.num_embeddings} rows of layer {name} "
                         f"(nn.Embedding) of --model {spec}: a token id past them indexes past its table; give "
                         f"--vocab {embedding.num_embeddings} or less")


# -- the presets ------------------------------------------------------------------------------------


def _tiny(in_features: int = 16, width: int = 32, depth: int = 3, classes: int = 4, batch_size: int = 8,
          seed: int = 0) -> Preset:
    return _mlp_preset("tiny", in_features, width, depth, classes, batch_size, seed)


def _mlp(in_features: int = 1024, width: int = 2048, depth: int = 8, classes: int = 1000, batch_size: int = 256,
         seed: int = 0) -> Preset:
    return _mlp_preset("mlp", in_features, width, depth, classes, batch_size, seed)


def _mlp_preset(name: str, in_features: int, width: int, depth: int, classes: int, batch_size: int,
                seed: int) -> Preset:
    """``depth`` hidden blocks of Linear + GELU, then a Linear classifier."""
    layers: list[nn.Module] = []
    features = in_features
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.GELU()]
        features = width
    layers.append(nn.Linear(features, classes))
    model = nn.Sequential(*layers)

    def make_batch(rows: int, device: torch.device | str) -> Batch:
        generator = _generator(seed)
        x = torch.randn(rows, in_features, generator=generator)
        y = torch.randint(0, classes, (rows,), generator=generator)
        return x.to(device), y.to(device)

    return Preset(
        name=name,
        description=f"MLP {in_features} -> {depth} x (Linear {width} + GELU) -> {classes} classes",
        model=model,
        make_batch=make_batch,
        loss=_cross_entropy,
        batch_size=batch_size,
        settings={"in_features": in_features, "width": width, "depth": depth, "classes": classes,
                  "batch_size": batch_size, "seed": seed},
    )


def _transformer(vocab: int = 4096, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, seq_len: int = 128,
                 mlp_ratio: int = 4, dropout: float = 0.0, batch_size: int = 8, seed: int = 0) -> Preset:
    if d_model % n_heads:
        raise ValueError(f"preset 'transformer': d_model={d_model} is not divisible by n_heads={n_heads}")
    # Embedding and head weights stay untied, as in the benchmark results recorded with these presets.
    layers: list[nn.Module] = [TokenAndPositionEmbedding(vocab, d_model, seq_len, dropout)]
    layers += [TransformerBlock(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers)]
    layers += [nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)]
    model = nn.Sequential(*layers)

    def make_batch(rows: int, device: torch.device | str) -> Batch:
        # Next-token prediction: the target is the input shifted by one position.
        tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=_generator(seed))
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    return Preset(
        name="transformer",
        description=(f"GPT-like, {n_layers} blocks, d_model {d_model}, {n_heads} heads, "
                     f"seq_len {seq_len}, vocab {vocab}"),
        model=model,
        make_batch=make_batch,
        loss=_next_token_loss,
        batch_size=batch_size,
        settings={"vocab": vocab, "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads,
                  "seq_len": seq_len, "mlp_ratio": mlp_ratio, "dropout": dropout, "batch_size": batch_size,
                  "seed": seed},
    )


_BUILDERS: dict[str, Callable[..., Preset]] = {"tiny": _tiny, "mlp": _mlp, "transformer": _transformer}


# -- transformer layers -----------------------------------------------------------------------------


class TokenAndPositionEmbedding(nn.Module):
    """Token ids ``(batch, seq)`` to ``(batch, seq, d_model)``: token embedding plus a learned
    position embedding, in one module so that the first slice holds both."""

    def __init__(self, vocab: int, d_model: int, max_seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(max_seq_len, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.dropout(self.token(ids) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, d_model // self.n_heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class TransformerBlock(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attention(ln(x))``, then ``x + mlp(ln(x))``.

    Takes and returns a ``(batch, seq, d_model)`` tensor, so blocks chain in an ``nn.Sequential``.
    """

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_attention = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_attention(x))
        return x + self.mlp(self.ln_mlp(x))


# -- losses and inputs ------------------------------------------------------------------------------


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target)


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _mean_square(output: Any, _target: Any) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model returned a {type(output).__name__}; profiling a custom model needs a tensor output")
    return output.float().square().mean()


def _generator(seed: int) -> torch.Generator:
    # Batches come from their own generator on the CPU, so a batch does not depend on the device
    # or on how much of the global random stream the model used.
    return torch.Generator().manual_seed(seed + 1)


__all__ = ["Preset", "build_preset", "check_trainable", "preset_from_factory", "preset_names", "preset_settings",
           "TokenAndPositionEmbedding", "CausalSelfAttention", "TransformerBlock"]

