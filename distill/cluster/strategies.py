"""Lightning strategy objects for the trainer presets
(``trainer=ddp|fsdp|deepspeed_zero2|deepspeed_zero3``).

Each preset is built here from its config block, never from a bare string, so what it shards, wraps,
offloads and in which precision it computes is decided in one place and inspected by
``tests/test_strategies.py`` and ``tests/test_sharded_strategies.py``:

* The frozen target is not a registered submodule of the LightningModule (see ``DistillModule``), so
  no strategy ever puts it in optimizer state, gradients or checkpoints. ``target.shard`` decides
  whether it is replicated on every GPU (default) or sharded across them
  (:mod:`draftsmith.distill.target.shard`).
* FSDP wraps each composite layer of the drafter (an ``Eagle3Layer``, a ``MedusaHead``, ...) in its
  own unit; the drafter's leaves (``fc``, ``norm``, ``lm_head``) stay in the root unit. Checkpoints
  are one full state-dict file (the drafter is small), so export and resume read the same file under
  every preset.
* DeepSpeed's ZeRO stage comes from the preset (2 or 3) with optimizer / parameter offload options.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from draftsmith.common.errors import ConfigError

# Lightning strategies that run on CUDA GPUs only, with the preset a CPU machine should use instead.
CUDA_ONLY = {"fsdp": "fsdp", "deepspeed": "deepspeed_zero2/deepspeed_zero3"}
CPU_ALTERNATIVE = "trainer=ddp trainer.accelerator=cpu (data parallel over CPU processes, gloo)"
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
# Leaf modules never get their own FSDP unit or checkpoint wrapper (too small to be worth a
# collective each).
_LEAVES = (nn.Linear, nn.Embedding, nn.LayerNorm)


def strategy_family(trainer_cfg: DictConfig) -> str:
    """``ddp`` | ``fsdp`` | ``deepspeed`` | ``single`` for the configured ``trainer.strategy``
    name."""
    name = str(trainer_cfg.strategy).lower()
    for family in ("fsdp", "deepspeed", "ddp"):
        if name.startswith(family):
            return family
    return "single"


def check_devices(trainer_cfg: DictConfig, cuda_available: bool | None = None) -> None:
    """Refuse a CUDA-only trainer preset (``trainer=gpu``, ``fsdp``, ``deepspeed_*``) on a machine
    without CUDA with one line naming the preset to use instead, before Lightning fails with its own
    less helpful error.
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return
    accelerator, strategy = str(trainer_cfg.accelerator).lower(), str(trainer_cfg.strategy).lower()
    family = strategy_family(trainer_cfg)
    if family in CUDA_ONLY:
        why = (
            f"trainer.strategy={strategy} (preset trainer={CUDA_ONLY[family]}, sharding over GPUs)"
        )
    elif accelerator in ("gpu", "cuda"):
        why = f"trainer.accelerator={accelerator}"
    else:
        return
    raise ConfigError(
        f"{why} needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); "
        f"on CPU use trainer=cpu (one process), or {CPU_ALTERNATIVE}"
    )


def layer_classes(drafter: nn.Module, names: Any = "auto") -> set[type[nn.Module]]:
    """The drafter's layer classes: FSDP units and activation-checkpointing boundaries.

    ``auto``: every composite module (one holding submodules) that is a direct child of the drafter
    or an element of one of its ``nn.ModuleList`` / ``nn.Sequential`` children, e.g. ``Eagle3Layer``
    or ``MedusaHead``. A list of class names picks those instead (a ConfigError names the classes
    the drafter has when one is absent).
    """
    found: dict[str, type[nn.Module]] = {type(m).__name__: type(m) for m in drafter.modules()}
    if isinstance(names, str) and names != "auto":
        names = [names]
    if names not in (None, "auto"):
        missing = [n for n in names if n not in found]
        if missing:
            raise ConfigError(
                f"wrap_classes {missing} are not modules of the drafter; "
                f"it has: {', '.join(sorted(found))}"
            )
        return {found[n] for n in names}
    candidates = []
    for child in drafter.children():
        container = isinstance(child, (nn.ModuleList, nn.Sequential))
        candidates.extend(child.children() if container else [child])
    return {
        type(m)
        for m in candidates
        if any(True for _ in m.children()) and not isinstance(m, _LEAVES)
    }


def trainer_device(trainer_cfg: DictConfig, cuda_available: bool | None = None) -> str:
    """The device type the trainer computes on: ``cuda`` (``accelerator`` gpu/cuda, or auto with
    CUDA) or ``cpu``."""
    accelerator = str(trainer_cfg.accelerator).lower()
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    return "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda) else "cpu"


def resolve_precision(
    trainer_cfg: DictConfig,
    caps: Any = None,
    cuda_available: bool | None = None,
    cuda_bf16: bool | None = None,
) -> tuple[str, str]:
    """``trainer.precision`` -> (Lightning precision, why). ``auto`` is ``bf16-mixed`` where the
    training device computes bf16 natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX,
    :mod:`draftsmith.kernels.cpu_caps`) and ``32-true`` elsewhere (emulated bf16 is several times
    slower than fp32). ``caps``, ``cuda_available`` and ``cuda_bf16`` inject the hardware (tests);
    by default it is probed."""
    from draftsmith.kernels import cpu_caps

    asked = str(trainer_cfg.precision)
    if asked.lower() != "auto":
        return asked, f"{asked} (as configured)"
    device = trainer_device(trainer_cfg, cuda_available)
    if device == "cuda":
        visible = torch.cuda.is_available() if cuda_available is None else cuda_available
        # no GPU to ask on this machine (a plan, a dry run): the GPUs trained on have bf16
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported() if visible else True
        native = cuda_bf16
        why = (
            ("the GPU computes bf16 natively" if visible else "a GPU preset; no GPU visible to ask")
            if native
            else "this GPU has no bf16 support"
        )
    else:
        native, why = cpu_caps.native_bf16("cpu", caps)
    return (
        ("bf16-mixed", f"auto -> bf16-mixed ({why})")
        if native
        else ("32-true", f"auto -> 32-true ({why})")
    )


def build_precision(trainer_cfg: DictConfig) -> Any | None:
    """The precision plugin a sharded strategy needs (``FSDPPrecision`` / ``DeepSpeedPrecision``),
    else None (Lightning picks it from ``trainer.precision``, ``auto`` resolved by
    :func:`resolve_precision`)."""
    precision = resolve_precision(trainer_cfg)[0]
    family = strategy_family(trainer_cfg)
    if family == "fsdp":
        from pytorch_lightning.plugins.precision import FSDPPrecision

        return FSDPPrecision(precision)
    if family == "deepspeed":
        from pytorch_lightning.plugins.precision import DeepSpeedPrecision

        return DeepSpeedPrecision(precision)
    return None


def _fsdp(trainer_cfg: DictConfig, drafter: nn.Module | None) -> Any:
    from pytorch_lightning.strategies import FSDPStrategy

    opts = trainer_cfg.get("fsdp") or {}
    sharding = str(opts.get("sharding_strategy", "FULL_SHARD")).upper()
    if sharding not in SHARDING_STRATEGIES:
        raise ConfigError(
            f"trainer.fsdp.sharding_strategy={sharding!r}; valid: {', '.join(SHARDING_STRATEGIES)}"
        )
    state_dict_type = str(opts.get("state_dict_type", "full"))
    if state_dict_type not in ("full", "sharded"):
        raise ConfigError(
            f"trainer.fsdp.state_dict_type={state_dict_type!r}; "
            "valid: full (one file), sharded (a folder)"
        )
    classes = (
        layer_classes(drafter, opts.get("wrap_classes", "auto")) if drafter is not None else None
    )
    checkpointing = (
        classes if bool(trainer_cfg.get("activation_checkpointing", False)) and classes else None
    )
    mesh = None
    # shard inside a node, replicate across nodes: mesh (nodes, GPUs per node)
    if sharding == "HYBRID_SHARD":
        from draftsmith.distill.cluster.attempts import planned_world_size

        nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
        mesh = (nodes, max(1, planned_world_size(trainer_cfg) // nodes))
    return FSDPStrategy(
        sharding_strategy=sharding,
        auto_wrap_policy=classes or None,
        activation_checkpointing_policy=checkpointing,
        cpu_offload=bool(opts.get("cpu_offload", False)),
        state_dict_type=state_dict_type,
        device_mesh=mesh,
    )


def deepspeed_stage(trainer_cfg: DictConfig) -> int:
    """The ZeRO stage named by ``trainer.strategy`` (``deepspeed_stage_3`` -> 3; bare ``deepspeed``
    -> 2, Lightning's default)."""
    name = str(trainer_cfg.strategy).lower()
    stage = int(name[-1]) if name.startswith("deepspeed_stage_") and name[-1].isdigit() else 2
    if name not in ("deepspeed", f"deepspeed_stage_{stage}"):
        raise ConfigError(
            f"trainer.strategy={name!r}; valid DeepSpeed names: deepspeed_stage_1|2|3 (presets "
            "trainer=deepspeed_zero2, trainer=deepspeed_zero3)"
        )
    return stage


def _deepspeed(trainer_cfg: DictConfig) -> Any:
    from pytorch_lightning.strategies import DeepSpeedStrategy

    opts = trainer_cfg.get("deepspeed") or {}
    stage = deepspeed_stage(trainer_cfg)
    offload_params = bool(opts.get("offload_parameters", False))
    if offload_params and stage != 3:
        raise ConfigError(
            "trainer.deepspeed.offload_parameters=true needs ZeRO stage 3 (trainer=deepspeed_zero3)"
        )
    return DeepSpeedStrategy(
        stage=stage,
        offload_optimizer=bool(opts.get("offload_optimizer", False)),
        offload_parameters=offload_params,
        logging_batch_size_per_gpu=int(opts.get("logging_batch_size_per_gpu", 1)),
    )


def build_strategy(trainer_cfg: DictConfig, drafter: nn.Module | None = None) -> Any:
    """The Lightning strategy object for ``trainer.strategy`` (``drafter``: the trainable module,
    for FSDP's auto-wrap and activation-checkpointing policies).

    ``ddp`` gets ``broadcast_buffers=False``: drafters hold the frozen target embedding / LM head as
    (identical, non-persistent) buffers, and re-broadcasting them every step would move hundreds of
    MB for nothing. On CPU, DDP uses gloo.
    """
    family = strategy_family(trainer_cfg)
    if family == "ddp":
        from pytorch_lightning.strategies import DDPStrategy

        backend = "gloo" if str(trainer_cfg.accelerator) == "cpu" else None
        return DDPStrategy(broadcast_buffers=False, process_group_backend=backend)
    if family == "fsdp":
        return _fsdp(trainer_cfg, drafter)
    if family == "deepspeed":
        return _deepspeed(trainer_cfg)
    return str(trainer_cfg.strategy)


def apply_activation_checkpointing(
    drafter: nn.Module, trainer_cfg: DictConfig
) -> set[type[nn.Module]]:
    """Recompute each drafter layer in backward (PyTorch's non-reentrant checkpoint wrapper) when
    ``trainer.activation_checkpointing`` is on, for strategies other than FSDP (FSDP applies the
    same policy itself). State-dict keys do not change (the wrapper strips its prefix), so
    checkpoints and exports read as before. Returns the wrapped classes (empty when off)."""
    if (
        not bool(trainer_cfg.get("activation_checkpointing", False))
        or strategy_family(trainer_cfg) == "fsdp"
    ):
        return set()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as wrap,
    )

    classes = layer_classes(drafter, (trainer_cfg.get("fsdp") or {}).get("wrap_classes", "auto"))
    wrap(drafter, check_fn=lambda m: isinstance(m, tuple(classes)))
    return classes
