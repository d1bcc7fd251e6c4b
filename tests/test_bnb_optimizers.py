"""bitsandbytes' 8-bit optimizers through OffloadOptimizer: ``AdamW8bit``, ``Adam8bit``,
``SGD8bit``, ``Lion8bit`` and the other 8-bit classes (RMSprop, Adagrad, LAMB, LARS, AdEMAMix)
keep each moment as uint8 codes (``state1``, ``state2``) with a float32 scale per 256-element block
(``absmax1``, ``absmax2``) and a 256-entry quantization map (``qmap1``, ``qmap2``); tensors under
``min_8bit_size`` elements keep float32 moments. bitsandbytes runs them on CPU tensors, so
OffloadOptimizer runs the class unchanged on its host worker, slice by slice: parameters and state
equal the same class run plainly, bit for bit (docs/optimizer.md, "Low-bit optimizers"). The state
is plain tensors, so a disk tier keeps all of it in its files.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

bnb = pytest.importorskip("bitsandbytes", reason="the bnb extra (bitsandbytes) is not installed")

EXACT = {"rtol": 0, "atol": 0}
#: The 8-bit classes that step CPU tensors, with the arguments they need (SGD8bit refuses to run
#: without momentum).
CLASSES = [
    pytest.param("AdamW8bit", {"lr": 1e-2, "weight_decay": 0.1}, id="AdamW8bit"),
    pytest.param("Adam8bit", {"lr": 1e-2}, id="Adam8bit"),
    pytest.param("SGD8bit", {"lr": 1e-2, "momentum": 0.9}, id="SGD8bit"),
    pytest.param("Lion8bit", {"lr": 1e-3}, id="Lion8bit"),
    pytest.param("RMSprop8bit", {"lr": 1e-3}, id="RMSprop8bit"),
    pytest.param("Adagrad8bit", {"lr": 1e-2}, id="Adagrad8bit"),
    pytest.param("LAMB8bit", {"lr": 1e-2}, id="LAMB8bit"),
    pytest.param("LARS8bit", {"lr": 1e-2, "momentum": 0.9}, id="LARS8bit"),
    pytest.param("AdEMAMix8bit", {"lr": 1e-2}, id="AdEMAMix8bit"),
]


def layers() -> nn.Sequential:
    # Weights of 16384 and 65536 elements (8-bit state), biases of 256 and 64 (float32 state under
    # the default min_8bit_size of 4096; 8-bit with min_8bit_size=0, a block of 256 partly used).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))


def twins(name: str, kwargs: dict, **model_kwargs):
    """The class stepping a plain model, and OffloadOptimizer running it on an OffloadModel.

    Under a compute dtype or microbatches the plain model is an OffloadModel of the same settings
    stepped by the class itself, so that the forward and the gradients are the same and only who
    runs the update differs; otherwise it is the unwrapped ``nn.Sequential``.
    """
    cls = getattr(bnb.optim, name)
    plain = layers()
    if model_kwargs:
        plain = OffloadModel(plain, device="cpu", num_slices=2, **model_kwargs)
    model = OffloadModel(layers(), device="cpu", num_slices=2, **model_kwargs)
    return plain, cls(plain.parameters(), **kwargs), model, OffloadOptimizer(model, cls, **kwargs)


def train(plain: nn.Module, reference: torch.optim.Optimizer, model: nn.Module, optimizer: torch.optim.Optimizer,
          steps: int, seed: int = 0) -> None:
    # The reference takes all its steps first: bitsandbytes' CPU kernels give wrong results now and
    # then when two threads run them at once (docs/optimizer.md, "Low-bit optimizers"), and the
    # OffloadOptimizer's update runs on its host worker, beside the caller.
    for net, opt in ((plain, reference), (model, optimizer)):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(12, 64, generator=generator)
            opt.zero_grad()
            net(x).float().square().mean().backward()
            opt.step()
    if isinstance(optimizer, OffloadOptimizer):
        optimizer.synchronize()


def assert_same_state(plain: nn.Module, reference: torch.optim.Optimizer, model: nn.Module,
                      optimizer: torch.optim.Optimizer) -> None:
    # Through state_by_slice() where it exists: it reads back what a disk tier keeps in its files.
    held = (dict(s for _, states in optimizer.state_by_slice() for s in states.items())
            if isinstance(optimizer, OffloadOptimizer) else optimizer.state)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q.detach(), **EXACT, msg=lambda m: f"{name}: {m}")
        mine, theirs = held[p], reference.state[q]
        assert mine.keys() == theirs.keys(), name
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                # assert_close checks the dtype too: uint8 codes stay codes.
                torch.testing.assert_close(mine[key], value, **EXACT, msg=lambda m: f"{name} {key}: {m}")
            else:
                assert mine[key] == value, (name, key)


def per_parameter_bytes(optimizer: torch.optim.Optimizer, params) -> int:
    """The state bytes of ``params`` but the quantization maps (shared by the parameters an
    optimizer instance steps)."""
    return sum(value.numel() * value.element_size() for p in params for key, value in optimizer.state[p].items()
               if isinstance(value, torch.Tensor) and not key.startswith("qmap"))


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("min_8bit_size", [None, 0], ids=["min-default", "min-0"])
@pytest.mark.parametrize("name, kwargs", CLASSES)
def test_8bit_class_through_offload_optimizer_is_the_class_run_plainly(name, kwargs, min_8bit_size, compute_dtype):
    if min_8bit_size is not None:
        kwargs = {**kwargs, "min_8bit_size": min_8bit_size}
    model_kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
    plain, reference, model, optimizer = twins(name, kwargs, **model_kwargs)
    train(plain, reference, model, optimizer, steps=3)
    assert_same_state(plain, reference, model, optimizer)
    # The moments really are 8-bit codes where the class makes them so, float32 where it does not.
    for p in model.parameters():
        eight_bit = p.numel() >= (4096 if min_8bit_size is None else 0)
        assert optimizer.state[p]["state1"].dtype == (torch.uint8 if eight_bit else torch.float32)


def test_8bit_state_with_microbatches():
    plain, reference, model, optimizer = twins("AdamW8bit", {"lr": 1e-2}, num_microbatches=3)
    train(plain, reference, model, optimizer, steps=3)
    assert_same_state(plain, reference, model, optimizer)


def test_8bit_update_in_backward():
    cls = bnb.optim.AdamW8bit
    plain = layers()
    model = OffloadModel(layers(), device="cpu", num_slices=2)
    reference = cls(plain.parameters(), lr=1e-2)
    optimizer = OffloadOptimizer(model, cls, lr=1e-2, update_in_backward=True)
    train(plain, reference, model, optimizer, steps=3)
    assert_same_state(plain, reference, model, optimizer)


def test_memory_footprint_counts_codes_scales_and_one_map_per_slice():
    plain, reference, model, optimizer = twins("AdamW8bit", {"lr": 1e-2})
    train(plain, reference, model, optimizer, steps=1)
    params = list(model.parameters())
    # Each slice's parameters are stepped by an instance of the class of their own, whose two
    # 256-entry float32 maps they share (the plain optimizer shares one pair among all).
    maps = 2 * 256 * 4 * 2
    counted = model.memory_footprint().host_optimizer_state
    assert counted == per_parameter_bytes(optimizer, params) + maps
    float32_state = 2 * 4 * sum(p.numel() for p in params)
    assert counted < float32_state / 3, (counted, float32_state)


@pytest.mark.parametrize("tiered", [False, True], ids=["ram", "disk-tier"])
def test_8bit_state_resumes_through_state_dict(tiered, tmp_path):
    plain, reference, model, optimizer = twins("AdamW8bit", {"lr": 1e-2})
    tier = {"disk_tier": tmp_path / "saved"} if tiered else {}
    optimizer = OffloadOptimizer(model, bnb.optim.AdamW8bit, lr=1e-2, **tier)
    train(plain, reference, model, optimizer, steps=2)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert saved["state"][0]["state1"].dtype == torch.uint8
    resumed_model = OffloadModel(layers(), device="cpu", num_slices=2)
    resumed_model.load_state_dict(model.state_dict())
    tier = {"disk_tier": tmp_path / "resumed"} if tiered else {}
    resumed = OffloadOptimizer(resumed_model, bnb.optim.AdamW8bit, lr=1e-2, **tier)
    # torch.optim would cast the codes to the parameters' float32; the class's own load keeps them.
    resumed.load_state_dict(saved)
    train(plain, reference, resumed_model, resumed, steps=2, seed=1)
    assert_same_state(plain, reference, resumed_model, resumed)
    optimizer.close()
    resumed.close()


@pytest.mark.parametrize("tiered", [False, True], ids=["ram", "disk-tier"])
def test_8bit_state_resumes_through_a_checkpoint(tiered, tmp_path):
    # Into a disk tier the state goes through the class's own load, then to the tier's files (not
    # straight into them, cast as torch.optim casts: the codes would become float32).
    from offload import load_checkpoint, save_checkpoint

    plain, reference, model, _ = twins("AdamW8bit", {"lr": 1e-2})
    tier = {"disk_tier": tmp_path / "saved"} if tiered else {}
    optimizer = OffloadOptimizer(model, bnb.optim.AdamW8bit, lr=1e-2, **tier)
    train(plain, reference, model, optimizer, steps=2)
    save_checkpoint(tmp_path / "checkpoint", model, optimizer)
    resumed_model = OffloadModel(layers(), device="cpu", num_slices=2)
    tier = {"disk_tier": tmp_path / "resumed"} if tiered else {}
    resumed = OffloadOptimizer(resumed_model, bnb.optim.AdamW8bit, lr=1e-2, **tier)
    load_checkpoint(tmp_path / "checkpoint", resumed_model, resumed)
    train(plain, reference, resumed_model, resumed, steps=2, seed=1)
    assert_same_state(plain, reference, resumed_model, resumed)
    optimizer.close()
    resumed.close()


def test_state_dicts_load_across_the_class_and_offload_optimizer():
    plain, reference, model, optimizer = twins("AdamW8bit", {"lr": 1e-2})
    train(plain, reference, model, optimizer, steps=2)
    # The class's own state_dict() nests its quantization state under a key of its own.
    from_class = OffloadOptimizer(OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2),
                                  bnb.optim.AdamW8bit, lr=1e-2)
    from_class.load_state_dict(reference.state_dict())
    plain_twin = copy.deepcopy(plain)
    into_class = bnb.optim.AdamW8bit(plain_twin.parameters(), lr=1e-2)
    into_class.load_state_dict(optimizer.state_dict())
    train(plain, reference, from_class.model, from_class, steps=2, seed=1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        into_class.zero_grad()
        plain_twin(torch.randn(12, 64, generator=generator)).square().mean().backward()
        into_class.step()
    assert_same_state(plain, reference, from_class.model, from_class)
    assert_same_state(plain, reference, plain_twin, into_class)


def test_8bit_state_in_the_disk_tier(tmp_path):
    plain, reference, model, _ = twins("AdamW8bit", {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, bnb.optim.AdamW8bit, lr=1e-2, disk_tier=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plain tensors all: no "stays in RAM" warning
        train(plain, reference, model, optimizer, steps=3)
    # Codes, scales and maps are plain tensors: all of them are in the tier's files, optimizer.state
    # keeps the step count.
    for p in model.parameters():
        assert set(optimizer.state[p]) == {"step"}
    footprint = model.memory_footprint()
    assert footprint.host_optimizer_state == 0
    # On disk: each parameter's codes and scales, and a copy of the maps per parameter.
    assert footprint.disk >= per_parameter_bytes(reference, plain.parameters())
    # state_dict() reads them back; the results stay the class's, bit for bit.
    mine, theirs = optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for index in theirs:
        quantized = theirs[index].pop("__bnb_optimizer_quant_state__")
        assert mine[index].keys() == {**theirs[index], **quantized}.keys()
        for key, value in {**theirs[index], **quantized}.items():
            torch.testing.assert_close(mine[index][key], value, **EXACT)
    train(plain, reference, model, optimizer, steps=2, seed=1)
    assert_same_state(plain, reference, model, optimizer)
    optimizer.close()


def test_paged_8bit_class_on_host_tensors_is_the_unpaged_class():
    # Paging moves state between device and host memory; on host tensors bitsandbytes falls back to
    # the unpaged class, with a warning: the same updates as AdamW8bit.
    plain = layers()
    model = OffloadModel(layers(), device="cpu", num_slices=2)
    reference = bnb.optim.AdamW8bit(plain.parameters(), lr=1e-2)
    optimizer = OffloadOptimizer(model, bnb.optim.PagedAdamW8bit, lr=1e-2)
    with pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU"):
        train(plain, reference, model, optimizer, steps=3)
    assert_same_state(plain, reference, model, optimizer)


@pytest.fixture
def fresh_manager():
    """bitsandbytes' process-wide override manager, empty for the test and restored after it."""
    saved = bnb.optim.GlobalOptimManager._instance
    bnb.optim.GlobalOptimManager._instance = None
    yield bnb.optim.GlobalOptimManager.get_instance()
    bnb.optim.GlobalOptimManager._instance = saved


def test_per_parameter_overrides_reach_the_parameters_stepped_by_proxy(fresh_manager):
    # Note: [bitsandbytes overrides]: a module override (read at the first step) and an override by
    # parameter, each on a weight the class would keep in 8 bits, one the first of its slice.
    nets = layers(), layers()
    for net in nets:
        fresh_manager.register_module_override(net[0], "weight", {"optim_bits": 32})
        fresh_manager.override_config(net[4].weight, "optim_bits", 32)
    plain, net = nets
    model = OffloadModel(net, device="cpu", num_slices=3)
    reference = bnb.optim.Adam8bit(plain.parameters(), lr=1e-2)
    optimizer = OffloadOptimizer(model, bnb.optim.Adam8bit, lr=1e-2)
    train(plain, reference, model, optimizer, steps=2)
    assert_same_state(plain, reference, model, optimizer)  # dtypes included
    assert [str(optimizer.state[p]["state1"].dtype) for p in model.parameters() if p.dim() == 2] == [
        "torch.float32", "torch.uint8", "torch.float32"]


def test_overrides_left_by_an_earlier_optimizer_apply_at_the_plain_positions_only(fresh_manager):
    # An optimizer over another model leaves its override keyed (group, index) = (0, 0) in the
    # manager; the plain class reads it for its own first parameter, and for none other.
    other = layers()
    fresh_manager.register_module_override(other[0], "weight", {"optim_bits": 32})
    other(torch.randn(2, 64)).square().mean().backward()
    bnb.optim.Adam8bit(other.parameters(), lr=1e-2).step()
    plain = layers()
    model = OffloadModel(layers(), device="cpu", num_slices=3)
    reference = bnb.optim.Adam8bit(plain.parameters(), lr=1e-2)
    optimizer = OffloadOptimizer(model, bnb.optim.Adam8bit, lr=1e-2)
    train(plain, reference, model, optimizer, steps=2)
    assert_same_state(plain, reference, model, optimizer)
    assert [str(optimizer.state[p]["state1"].dtype) for p in model.parameters() if p.dim() == 2] == [
        "torch.float32", "torch.uint8", "torch.uint8"]


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "lion_8bit"])
def test_the_trainers_8bit_optim_keeps_embeddings_in_32_bits_as_the_plain_trainer(optim, fresh_manager, tmp_path):
    # Trainer.create_optimizer asks bitsandbytes for 32-bit state for every nn.Embedding's weight;
    # offload_optimizer does the same. An embedding of 96 x 64 would be in 8 bits without it.
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from offload.integrations.causal_lm import OffloadedCausalLM

    ids = torch.randint(1, 96, (8, 10), generator=torch.Generator().manual_seed(3)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    runs = []
    for kind in ("plain", "offloaded"):
        # Each run with a manager of its own, as in a process of its own: the plain run's overrides,
        # left keyed by position, would otherwise reach the offloaded run's embedding too.
        bnb.optim.GlobalOptimManager._instance = None
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
        hf = transformers.AutoModelForCausalLM.from_config(config)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / kind), use_cpu=True, report_to=[], optim=optim,
                                              per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                                              save_strategy="no", seed=0, disable_tqdm=True)
        model = hf if kind == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        optimizers = (None, None) if kind == "plain" else (model.offload_optimizer(args), None)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers)
        trainer.train()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if kind == "offloaded":
            optimizer.synchronize()
        runs.append((hf, optimizer))
    (plain, reference), (hf, optimizer) = runs
    assert reference.state[plain.model.embed_tokens.weight]["state1"].dtype == torch.float32
    assert_same_state(plain, reference, hf, optimizer)
