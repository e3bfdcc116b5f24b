"""Typed training config: one dataclass per shared group (run, validation, target, distill, optim,
data, trainer, logger), ``TrainConfig`` tying them together; each recipe's schema subclasses it
(``recipes/<name>/__init__.py``).

A field is declared once, with :func:`key`: its type, its one-line doc, its allowed range and, where
one value serves every run, its default (that default *is* the value: no YAML file repeats it).
Fields whose value comes from a preset the config picks (``target=``, ``data=``, ``trainer=``,
``logger=``: the files of ``conf/<group>/``) default to ``MISSING``. Hydra composes the classes
(``recipes/registration.py`` stores each recipe's schema in its ConfigStore), so a wrong type or a
misspelt key is refused by the config system itself, and :mod:`draftsmith.distill.config.checks`
reads the same metadata for the ranges, before anything loads, and for ``train.py --help``.

Adding a key: add a field with ``key("one-line doc", default, <range>)`` (:mod:`.keys`) to the
group's class here (or to the recipe's own group, beside its schema).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from draftsmith.distill.config.keys import group, key


def valid_devices(value: Any) -> bool:
    """Lightning's ``devices``: ``-1`` or ``auto`` (every visible device), a count >= 1, or a list
    of device ids."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
        )
    if isinstance(value, str):
        text = value.strip()
        return text == "auto" or (text.lstrip("-").isdigit() and valid_devices(int(text)))
    return isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= 1)


def valid_duration(value: Any) -> bool:
    """Lightning's ``max_time`` text: ``DD:HH:MM:SS``, hours below 24 and minutes, seconds below
    60."""
    found = re.fullmatch(r"(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})", str(value).strip())
    return found is not None and int(found[2]) < 24 and int(found[3]) < 60 and int(found[4]) < 60


# Lightning's accepted names, restricted to what the presets and distill/cluster/strategies.py
# build.
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
STRATEGIES = (
    "auto",
    "single_device",
    "ddp",
    "fsdp",
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
)
# auto: chosen per device by distill/cluster/strategies.py (bf16 where it computes natively)
PRECISIONS = (
    "auto",
    "32-true",
    "32",
    "bf16-mixed",
    "bf16-true",
    "bf16",
    "16-mixed",
    "16-true",
    "16",
    "64-true",
    "64",
)


@dataclass
class RecipeName:
    name: str = key("the training method (conf/recipe/<name>.yaml)")


@dataclass
class RunConfig:
    seed: int = key("seed of the initialisation and of the data order", 0)
    checkpoint_every: int = key("steps between atomic checkpoints", 50, ge=1)
    keep_checkpoints: int = key(
        "newest step checkpoints kept (checkpoints/last.ckpt links the newest)", 2, ge=1
    )
    requeue: bool = key(
        "under SLURM: on SIGUSR1 save hpc_ckpt_<n>.ckpt and `scontrol requeue` the job", True
    )
    resume: str = key(
        "auto: continue from the run folder's newest checkpoint; false: start fresh; changed:"
        " continue although optim/data keys changed, with the new values",
        "auto",
        choices=("auto", "true", "false", "changed"),
    )
    export: bool = key("export into <run dir>/export at the end of training", True)
    val_every: int = key("steps between validation passes (0 = only at the end)", 0, ge=0)
    final_eval_batches: int = key(
        "validation batches at the end (per-head agreement etc.)", 8, ge=0
    )
    zero_loss_patience: int = key(
        "stop after this many consecutive steps whose training loss is exactly 0.0 (0 = off)",
        5,
        ge=0,
    )
    init_from: str | None = key(
        "warm start: an export folder whose drafter weights a fresh run starts from (new "
        "warm-up, the same data order continued)",
        None,
        null="train from scratch",
    )


@dataclass
class ServedTauConfig:
    every: int = key("probe every N-th validation pass (and the final one); 0 = off", 1, ge=0)
    prompts: int = key(
        "held-out prompts served at each probe (few: it runs at validation, not as a bench)",
        4,
        ge=1,
    )
    max_new_tokens: int = key("tokens generated per prompt", 32, ge=1)
    # MT-Bench past 40: the benches' first prompts never include them
    prompt_set: str = key(
        "mtbench | humaneval | a .jsonl with a `prompt` field; NAME[a:b] a slice of one",
        "mtbench[40:]",
    )
    dtype: str = key(
        "the runtime's dtype, as `draftsmith bench`", "auto", choices=("auto", "fp32", "bf16")
    )
    # training loss keeps falling after held-out acceptance peaks: serve the best, not the last
    keep_best: bool = key(
        "keep the export whose probe served best at <run dir>/export_best (beside the last)", True
    )


@dataclass
class ValidationConfig:
    served_tau: ServedTauConfig = group(ServedTauConfig)


@dataclass
class TargetConfig:
    name_or_path: str = key(
        "the frozen target: a HF causal-LM folder, a hub name or smollm2-135m (embedded)"
    )
    dtype: str = key(
        "the target's dtype; auto: bf16 where the device computes it natively, else fp32",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    trust_remote_code: bool = key("let transformers run the model folder's own code")
    shard: bool = key(
        "shard the frozen target (trainer=fsdp or deepspeed_zero3) instead of a copy per device; "
        "never in optimizer state or checkpoints either way",
        False,
    )


@dataclass
class DistillConfig:
    labels: str = key(
        "training labels: the data's tokens, or the target's greedy / soft predictions",
        "dataset",
        choices=("dataset", "target_argmax", "target_soft"),
    )


@dataclass
class OptimConfig:
    lr: float = key(
        "peak learning rate (0 runs the pipeline without changing a weight)", 1.0e-3, ge=0
    )
    weight_decay: float = key("AdamW weight decay", 0.0, ge=0)
    betas: list[float] = key("AdamW betas", [0.9, 0.999], ge=0, lt=1, length=2)
    eps: float = key("AdamW epsilon", 1.0e-8, gt=0)
    scheduler: str = key(
        "learning-rate schedule after warmup (wsd: constant, then linear to 0 over decay_steps)",
        "cosine",
        choices=("constant", "linear", "cosine", "wsd"),
    )
    warmup_steps: int = key("linear warmup steps", 10, ge=0)
    decay_steps: int = key(
        "scheduler=wsd: the last steps, whose LR falls linearly to 0 (a cooldown)", 0, ge=0
    )
    grad_clip: float = key("gradient clipping threshold (0 = none)", 1.0, ge=0)
    grad_clip_algorithm: str = key(
        "norm: rescale the global gradient norm to grad_clip | value: clamp each element",
        "norm",
        choices=("norm", "value"),
    )


@dataclass
class DataConfig:
    spec: str = key(
        "sharegpt (embedded) | a .jsonl/.json/.parquet file or folder | an HF dataset name"
    )
    limit: int | None = key("conversations to use", ge=1, null="all")
    max_length: int = key("tokens kept per row", ge=8)
    batch_size: int = key("rows per batch (per device)", ge=1)
    packing: bool = key("false: length bucketing; true: greedy packing of conversations per row")
    val_fraction: float = key("share of conversations held out for validation", ge=0, lt=1)
    num_workers: int = key("DataLoader worker processes", ge=0)
    features: str | None = key(
        "a `draftsmith cache-features` folder: train from cached target features",
        null="run the target",
    )
    tokens_per_step: int | None = key(
        "a batch in tokens: packed rows of max_length, tokens_per_step // max_length of them",
        None,
        ge=8,
        null="data.batch_size rows",
    )


@dataclass
class FsdpConfig:
    sharding_strategy: str = key(
        "how FSDP shards the drafter",
        choices=("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"),
    )
    wrap_classes: Any = key(
        "FSDP units: auto = each composite layer of the drafter, or a list of class names"
    )
    cpu_offload: bool = key("parameters and gradients in host memory between uses")
    state_dict_type: str = key(
        "full: one checkpoint file on rank 0 | sharded: a folder", choices=("full", "sharded")
    )


@dataclass
class DeepspeedConfig:
    offload_optimizer: bool = key("AdamW state and step on the CPU (ZeRO-Offload)")
    offload_parameters: bool = key("drafter parameters in host memory between uses (stage 3 only)")
    logging_batch_size_per_gpu: int = key("batch size DeepSpeed logs with", ge=1)


@dataclass
class TrainerConfig:
    accelerator: str = key("the device kind Lightning trains on", choices=ACCELERATORS)
    devices: Any = key(
        "devices per node",
        check=valid_devices,
        allowed="-1 or auto (every visible device), a count >= 1, or a list of device ids",
    )
    strategy: str = key(
        "Lightning strategy (the trainer=PRESET files pick one)", choices=STRATEGIES
    )
    precision: Any = key(
        "the drafter's math (the frozen target runs in target.dtype)", choices=PRECISIONS
    )
    max_steps: int = key("optimizer steps to train", ge=1)
    max_time: str | None = key(
        "wall-clock cap; training stops at max_steps or max_time",
        check=valid_duration,
        allowed="DD:HH:MM:SS, e.g. 00:12:00:00",
        null="none",
    )
    accumulate_grad_batches: int = key("batches per optimizer step", ge=1)
    log_every_n_steps: int = key("steps between logged metrics", ge=1)
    num_nodes: int = key("nodes (SLURM's node count wins when larger)", ge=1)
    activation_checkpointing: bool = key("recompute the drafter's layers in backward")
    compile: bool | None = key(
        "torch.compile the target forward and the drafter's loss (static shapes: packed rows)",
        None,
        null="off",
    )
    fsdp: FsdpConfig | None = key("FSDP options (trainer=fsdp)", None)
    deepspeed: DeepspeedConfig | None = key("DeepSpeed options (trainer=deepspeed_zero2|3)", None)


@dataclass
class LoggerConfig:
    kind: str = key("csv (always written) | wandb (in addition)", choices=("csv", "wandb"))
    mode: str | None = key(
        "wandb: offline | online | disabled", None, choices=("offline", "online", "disabled")
    )
    project: str | None = key("wandb project", None)
    entity: str | None = key("wandb entity", None)
    name: str | None = key("wandb run name", None, null="<recipe>-<overrides>")
    group: str | None = key("wandb group", None, null="the recipe name")


@dataclass
class TrainConfig:
    """Keys every recipe has; a recipe's schema adds its own groups."""

    recipe: RecipeName = group(RecipeName)
    run: RunConfig = group(RunConfig)
    validation: ValidationConfig = group(ValidationConfig)
    target: TargetConfig = group(TargetConfig)
    distill: DistillConfig = group(DistillConfig)
    optim: OptimConfig = group(OptimConfig)
    data: DataConfig = group(DataConfig)
    trainer: TrainerConfig = group(TrainerConfig)
    logger: LoggerConfig = group(LoggerConfig)


@dataclass
class LossConfig:
    """The vocabulary-wide head's cross-entropy (``loss``), shared by the recipes that have one."""

    fused_linear_ce: Any = key(
        "chunked linear + CE, never the [tokens, vocab] logits (auto = true)",
        "auto",
        choices=("auto", "true", "false"),
    )
    chunk_size: int | None = key(
        "rows per chunk",
        None,
        ge=1,
        null="about 64 MiB of fp32 logits (341 rows at a 49k vocabulary)",
    )
    lm_head_dtype: str = key(
        "auto: follow trainer.precision | fp32 | bf16 (bf16 matmuls, fp32 accumulation)",
        "auto",
        choices=("auto", "fp32", "bf16"),
    )
    acceptance: str = key(
        "none: cross-entropy | hybrid: LK's KL/TV blend | nla: -log acceptance | tv: 1 -"
        " acceptance",
        "none",
        choices=("none", "hybrid", "nla", "tv"),
    )
    acceptance_eta: float = key(
        "hybrid: KL weight exp(-eta * acceptance), the rest on 1 - acceptance", 3.0, gt=0
    )
