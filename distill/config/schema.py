"""Typed training config: one dataclass per shared group (run, validation, target, distill, optim, data, trainer,
logger), ``TrainConfig`` tying them together; each recipe's schema subclasses it (``recipes/schemas.py``).

The YAML files in ``conf/`` hold the values; these classes hold each key's type, its one-line doc and its allowed
range, declared once with :func:`key`. Fields default to ``MISSING`` so merging a schema never overwrites a value a
YAML file set (a key only some presets carry defaults to None). Hydra composes them (``recipes/schemas.py`` stores
them in its ConfigStore), so a wrong type or a misspelt key is refused by the config system itself, and
:mod:`draftsmith.distill.config.checks` reads the same metadata for the ranges and for ``train.py --help``.

Adding a key: add a field with ``key("one-line doc", <range>)`` to the group's class here (or to the recipe's class
in ``recipes/schemas.py``) and its value to the YAML file that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


def key(doc: str, default: Any = MISSING, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, choices: tuple[str, ...] | None = None,
        length: int | None = None, null: str | None = None) -> Any:
    """A config field: ``doc`` (one line, shown by ``--help``) and its allowed range, checked before anything loads:
    bounds (``ge``/``gt``/``le``/``lt``, on each element of a list), ``choices`` (compared case-insensitively as
    text), ``length`` (of a list), ``null`` (what null means, for a key that may be null)."""
    rules = {name: value for name, value in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt), ("choices", choices),
                                             ("length", length), ("null", null)) if value is not None}
    return field(default=default, metadata={"doc": doc, **rules})


def group(cls: type) -> Any:
    """A nested group field (its keys come from ``cls``)."""
    return field(default_factory=cls)


@dataclass
class RecipeName:
    name: str = key("the training method (conf/recipe/<name>.yaml)")


@dataclass
class RunConfig:
    seed: int = key("seed of the initialisation and of the data order")
    checkpoint_every: int = key("steps between atomic checkpoints", ge=1)
    keep_checkpoints: int = key("newest step checkpoints kept (checkpoints/last.ckpt links the newest)", ge=1)
    requeue: bool = key("under SLURM: on SIGUSR1 save a checkpoint and requeue the job")
    resume: str = key("auto: continue from the run folder's newest checkpoint; false: start fresh",
                      choices=("auto", "true", "false"))
    export: bool = key("export into <run dir>/export at the end of training")
    val_every: int = key("steps between validation passes (0 = only at the end)", ge=0)
    final_eval_batches: int = key("validation batches at the end (per-head agreement etc.)", ge=0)
    zero_loss_patience: int = key("stop after this many steps whose training loss is exactly 0.0 (0 = off)", ge=0)
    init_from: str | None = key("warm start: an export folder whose drafter weights a fresh run starts from (new "
                                "warm-up, the same data order continued)", None, null="train from scratch")


@dataclass
class ServedTauConfig:
    every: int = key("probe every N-th validation pass (and the final one); 0 = off", ge=0)
    prompts: int = key("held-out prompts served at each probe", ge=1)
    max_new_tokens: int = key("tokens generated per prompt", ge=1)
    prompt_set: str = key("mtbench | humaneval | a .jsonl with a `prompt` field; NAME[a:b] a slice of one")
    dtype: str = key("the runtime's dtype, as `draftsmith bench`", choices=("auto", "fp32", "bf16"))
    keep_best: bool = key("keep the export whose probe served best at <run dir>/export_best (beside the last)")


@dataclass
class ValidationConfig:
    served_tau: ServedTauConfig = group(ServedTauConfig)


@dataclass
class TargetConfig:
    name_or_path: str = key("the frozen target: a HF causal-LM folder, a hub name or smollm2-135m (embedded)")
    dtype: str = key("the target's dtype; auto: bf16 where the device computes it natively, else fp32",
                     choices=("auto", "bf16", "fp16", "fp32"))
    trust_remote_code: bool = key("let transformers run the model folder's own code")
    shard: bool = key("shard the frozen target (trainer=fsdp or deepspeed_zero3) instead of a copy per device")


@dataclass
class DistillConfig:
    labels: str = key("training labels: the data's tokens, or the target's greedy / soft predictions",
                      choices=("dataset", "target_argmax", "target_soft"))


@dataclass
class OptimConfig:
    lr: float = key("peak learning rate (0 runs the pipeline without changing a weight)", ge=0)
    weight_decay: float = key("AdamW weight decay", ge=0)
    betas: list[float] = key("AdamW betas", ge=0, lt=1, length=2)
    eps: float = key("AdamW epsilon", gt=0)
    scheduler: str = key("learning-rate schedule after warmup (wsd: constant, then linear to 0 over decay_steps)",
                         choices=("constant", "linear", "cosine", "wsd"))
    warmup_steps: int = key("linear warmup steps", ge=0)
    decay_steps: int = key("scheduler=wsd: the last steps, whose LR falls linearly to 0 (a cooldown)", 0, ge=0)
    grad_clip: float = key("gradient clipping threshold (0 = none)", ge=0)
    grad_clip_algorithm: str = key("norm: rescale the global gradient norm | value: clamp each element",
                                   choices=("norm", "value"))


@dataclass
class DataConfig:
    spec: str = key("sharegpt (embedded) | a .jsonl/.json/.parquet file or folder | an HF dataset name")
    limit: int | None = key("conversations to use", ge=1, null="all")
    max_length: int = key("tokens kept per row", ge=8)
    batch_size: int = key("rows per batch (per device)", ge=1)
    packing: bool = key("false: length bucketing; true: greedy packing of conversations per row")
    val_fraction: float = key("share of conversations held out for validation", ge=0, lt=1)
    num_workers: int = key("DataLoader worker processes", ge=0)
    features: str | None = key("a `draftsmith cache-features` folder: train from cached target features",
                               null="run the target")


@dataclass
class FsdpConfig:
    sharding_strategy: str = key("FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD")
    wrap_classes: Any = key("FSDP units: auto = each composite layer of the drafter, or a list of class names")
    cpu_offload: bool = key("parameters and gradients in host memory between uses")
    state_dict_type: str = key("full: one checkpoint file on rank 0")


@dataclass
class DeepspeedConfig:
    offload_optimizer: bool = key("AdamW state and step on the CPU (ZeRO-Offload)")
    offload_parameters: bool = key("drafter parameters in host memory between uses (stage 3 only)")
    logging_batch_size_per_gpu: int = key("batch size DeepSpeed logs with", ge=1)


@dataclass
class TrainerConfig:
    accelerator: str = key("cpu | gpu | auto")
    devices: Any = key("devices per node (-1: every visible GPU)")
    strategy: str = key("Lightning strategy: auto | ddp | fsdp | deepspeed_stage_2 | deepspeed_stage_3")
    precision: Any = key("the drafter's math: 32-true | bf16-mixed | ...")
    max_steps: int = key("optimizer steps to train", ge=1)
    max_time: str | None = key('wall-clock cap "DD:HH:MM:SS"', null="none")
    accumulate_grad_batches: int = key("batches per optimizer step", ge=1)
    log_every_n_steps: int = key("steps between logged metrics", ge=1)
    num_nodes: int = key("nodes (SLURM's node count wins when larger)", ge=1)
    activation_checkpointing: bool = key("recompute the drafter's layers in backward")
    fsdp: FsdpConfig | None = key("FSDP options (trainer=fsdp)", None)
    deepspeed: DeepspeedConfig | None = key("DeepSpeed options (trainer=deepspeed_zero2|3)", None)


@dataclass
class LoggerConfig:
    kind: str = key("csv (always written) | wandb (in addition)", choices=("csv", "wandb"))
    mode: str | None = key("wandb: offline | online | disabled", None, choices=("offline", "online", "disabled"))
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

    fused_linear_ce: Any = key("chunked linear + CE, never the [tokens, vocab] logits (auto = true)",
                               choices=("auto", "true", "false"))
    chunk_size: int | None = key("rows per chunk", ge=1, null="about 64 MiB of fp32 logits")
    lm_head_dtype: str = key("auto: follow trainer.precision | fp32 | bf16", choices=("auto", "fp32", "bf16"))
    acceptance: str = key("none: cross-entropy | hybrid: LK's KL/TV blend | nla: -log acceptance | tv: 1 - acceptance",
                          "none", choices=("none", "hybrid", "nla", "tv"))
    acceptance_eta: float = key("hybrid blend: lam = exp(-eta * acceptance)", 3.0, gt=0)
    replay_weight: float = key("extra loss weight on verification-exposed rejected positions (EAGLE-3; 0 = off)",
                               0.0, ge=0)
