"""Each recipe's config schema: ``TrainConfig`` (the shared groups, distill/config/schema.py) plus the recipe's own
groups, with a type, a one-line doc and a range per key. Stored in Hydra's ConfigStore as ``schema/<recipe>``;
``conf/train.yaml`` merges the chosen recipe's schema first (``schema@_global_: ${recipe}``), so Hydra refuses a key
the schema lacks and a value of the wrong type. Values live in the YAML files; a field here defaults to MISSING.

A new recipe adds one class here and one line to :data:`SCHEMAS`; a new key adds one field.
Light on purpose (no torch): train.py imports it before Hydra composes anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith.distill.config.schema import LossConfig, TrainConfig, group, key


@dataclass
class TreeInference:
    """A static/calibrated tree of head drafts (Medusa, Hydra, Clover)."""

    tree_nodes: int = key("node budget of the draft tree", ge=1)
    top_k: int = key("candidates per head", ge=1)
    verifier: str = key("greedy (lossless) | typical (Medusa's lossy rule) | rejection (lossless sampling)",
                        choices=("greedy", "typical", "rejection"))
    posterior_threshold: float = key("typical acceptance: probability floor", ge=0)
    posterior_alpha: float = key("typical acceptance: entropy-scaled floor", ge=0)


@dataclass
class DynamicTreeInference:
    """EAGLE-2's dynamic tree (EAGLE-1, EAGLE-3)."""

    total_tokens: int = key("draft nodes verified per step", ge=1)
    depth: int = key("draft steps per round", ge=1)
    top_k: int = key("children expanded per frontier node", ge=1)
    verifier: str = key("greedy (lossless) | rejection (lossless sampling)", choices=("greedy", "rejection"))


@dataclass
class MedusaHeads:
    num_heads: int = key("draft heads (head k predicts token t+k+2)", ge=1)
    num_layers: int = key("residual blocks per head", ge=1)
    share_lm_head: bool = key("reuse the frozen target LM head instead of one copy per head")
    draft_vocab_size: int | None = key("heads score only the N most frequent assistant tokens", ge=0,
                                       null="0 or null: the whole vocabulary")
    vocab_samples: int | None = key("training conversations scanned for token counts", ge=1, null="all")
    decay: float = key("weight of head k: decay^(k+1)", gt=0, le=1)
    topk_metric: int = key("k of the logged top-k accuracy", ge=1)


@dataclass
class Medusa(TrainConfig):
    heads: MedusaHeads = group(MedusaHeads)
    loss: LossConfig = group(LossConfig)
    inference: TreeInference = group(TreeInference)


@dataclass
class Medusa2Heads(MedusaHeads):
    coefficient: float = key("lambda_0: weight of the heads' loss", ge=0)
    lr_multiplier: float = key("heads LR = lr_multiplier x optim.lr", gt=0)
    warmup_steps: int = key("heads-only steps before joint training", ge=0)


@dataclass
class Adapter:
    rank: int = key("LoRA rank", ge=1)
    alpha: float = key("LoRA alpha", gt=0)
    dropout: float = key("LoRA dropout", ge=0, lt=1)
    target_modules: list[str] = key("modules that get adapters")
    lm_weight: float = key("weight of the backbone's own loss", ge=0)
    self_distill: bool = key("backbone loss = KL(original target || adapted)")


@dataclass
class Medusa2(TrainConfig):
    heads: Medusa2Heads = group(Medusa2Heads)
    adapter: Adapter = group(Adapter)
    inference: TreeInference = group(TreeInference)


@dataclass
class HydraHeads:
    num_heads: int = key("draft heads", ge=1)
    num_layers: int = key("grounded block + (num_layers - 1) ResBlocks", ge=1)
    dropout: float = key("dropout in the heads", ge=0, lt=1)
    prefix_layer: bool = key("Hydra++: a decoder layer attending over the context before the heads")
    share_lm_head: bool = key("reuse the frozen target LM head instead of one copy per head")
    decay: float = key("per-head loss weight decay^(k+1)", gt=0, le=1)
    topk_metric: int = key("k of the logged top-k accuracy", ge=1)


@dataclass
class Hydra(TrainConfig):
    heads: HydraHeads = group(HydraHeads)
    inference: TreeInference = group(TreeInference)


@dataclass
class CloverHeads:
    num_heads: int = key("draft heads (tree depth)", ge=1)
    num_layers: int = key("augmenting decoder layers", ge=1)
    embed_source: str = key("embed: the target's input embedding | lm_head: its LM head",
                            choices=("embed", "lm_head"))
    feature_weight: float = key("v_w: weight of the feature regression", ge=0)
    token_weight: float = key("p_w: weight of the token loss", ge=0)
    decay: float = key("per-head loss weight decay^i", gt=0, le=1)
    topk_metric: int = key("k of the logged top-k accuracy", ge=1)


@dataclass
class Clover2(TrainConfig):
    heads: CloverHeads = group(CloverHeads)
    inference: TreeInference = group(TreeInference)


@dataclass
class EagleNoise:
    kind: str = key("uniform: U(-scale, scale) per element | none", choices=("uniform", "none"))
    scale: float = key("the noise's half-width", ge=0)
    ref_len: int | None = key("scale * ref_len / T for padded width T (EAGLE's code: 512)", ge=1,
                              null="independent of the batch shape")


@dataclass
class EagleDrafter:
    feature_weight: float = key("v_w: weight of the feature regression", ge=0)
    token_weight: float = key("p_w: weight of the token loss", ge=0)
    noise: EagleNoise = group(EagleNoise)
    noise_std: float | None = key("older form of noise: (U(0,1) - 0.5) * noise_std * noise_ref_len / T", None,
                                  ge=0, null="use drafter.noise")
    noise_ref_len: int | None = key("older form of noise: see noise_std", None, ge=1, null="no length scaling")
    topk_metric: int = key("k of the logged top-k accuracy", ge=1)


@dataclass
class Eagle(TrainConfig):
    drafter: EagleDrafter = group(EagleDrafter)
    loss: LossConfig = group(LossConfig)
    inference: DynamicTreeInference = group(DynamicTreeInference)


@dataclass
class Eagle3Drafter:
    target_layers: list[int] | None = key("HF hidden_states indices fused", null="(2, L//2, L-3)")
    draft_vocab_size: int | None = key("reduced draft vocabulary", ge=0, null="0 or null: the full vocabulary")
    vocab_samples: int | None = key("training conversations scanned for token frequencies", ge=1, null="all")
    init_lm_head_from_target: bool = key("initialise the draft LM head from the target's rows")
    ttt_steps: int = key("training-time-test steps unrolled (the paper: 7)", ge=1)
    step_decay: float = key("loss weight of TTT step j: step_decay^j", gt=0, le=1)
    topk_metric: int = key("k of the logged top-k accuracy", ge=1)


@dataclass
class Eagle3(TrainConfig):
    drafter: Eagle3Drafter = group(Eagle3Drafter)
    loss: LossConfig = group(LossConfig)
    inference: DynamicTreeInference = group(DynamicTreeInference)


@dataclass
class DFlashDrafter:
    block_size: int = key("slots per block: the verified token + block_size-1 drafts", ge=2)
    num_layers: int = key("draft decoder layers", ge=1)
    intermediate_size: int | None = key("MLP width", ge=1, null="the target's")
    target_layers: list[int] | None = key("HF hidden_states indices injected", null="num_taps spread over depth")
    num_taps: int = key("taps spread over depth when target_layers is null", ge=1)
    mask_token_id: int | None = key("the mask token", ge=0, null="first special token absent from the data")
    mask_scan_samples: int | None = key("conversations scanned for the mask-token check", ge=1, null="all")
    anchors_per_seq: int = key("random blocks per sequence per step", ge=1)
    position_decay: float = key("loss weight of slot k: position_decay^(k-1)", gt=0, le=1)
    confidence_head: bool = key("per-slot acceptance head; the export serves it at the cut validation picked")
    confidence_weight: float = key("weight of the confidence head's BCE", ge=0)
    markov_head: bool = key("low-rank term from the previous slot's token")
    markov_rank: int = key("rank of the Markov head", ge=1)
    topk_metric: int = key("k of the logged top-k accuracy", ge=1)
    output_norm_init: float | None = key("initial gain of the output norm", gt=0, null="min(1, 1/LM-head row norm)")


@dataclass
class DFlashInference:
    verifier: str = key("greedy (lossless) | rejection (lossless sampling)", choices=("greedy", "rejection"))
    cut: float | None = key("confidence cut: stop after the slot whose cumulative confidence falls below it",
                            ge=0, lt=1, null="the cut validation finds best with a head, off without one")
    cut_token_cost: float = key("what one more drafted token adds to a verify step, as a share of a step", ge=0)


@dataclass
class DFlash(TrainConfig):
    drafter: DFlashDrafter = group(DFlashDrafter)
    loss: LossConfig = group(LossConfig)
    inference: DFlashInference = group(DFlashInference)


@dataclass
class KangarooDrafter:
    exit_layer: Any = key("auto (~depth/16) or the number of shared target layers (>= 1)")
    topk_metric: int = key("k of the logged top-k accuracy", ge=1)


@dataclass
class KangarooInference:
    threshold: float = key("stop drafting once the draft's top-1 probability < threshold", ge=0, le=1)
    max_depth: int = key("at most this many drafted tokens per step", ge=1)
    verifier: str = key("greedy (lossless) | rejection (lossless sampling)", choices=("greedy", "rejection"))


@dataclass
class Kangaroo(TrainConfig):
    drafter: KangarooDrafter = group(KangarooDrafter)
    loss: LossConfig = group(LossConfig)
    inference: KangarooInference = group(KangarooInference)


@dataclass
class SpecDecHead:
    num_layers: int = key("independent ResBlocks", ge=1)
    reject_weight: float = key("weight of the reject class in the soft BCE", gt=0)
    temperature: float = key("draft / verify temperature of the labels (0 = greedy)", ge=0)
    mixing_ratio: float = key("share of candidates replaced by the target's own token", ge=0, le=1)
    mixed_in_loss: bool = key("count the labels of mixed positions")


@dataclass
class SpecDecInference:
    threshold: float = key("stop once P(some drafted token is rejected) > threshold", gt=0, lt=1)
    min_depth: int = key("drafted tokens before the head may stop", ge=1)
    max_depth: int = key("at most this many drafted tokens", ge=1)
    verifier: str = key("greedy (lossless) | rejection (lossless sampling)", choices=("greedy", "rejection"))


@dataclass
class SpecDecPP(TrainConfig):
    drafter: str | None = key("REQUIRED: the chain drafter export the head is trained on", None)
    head: SpecDecHead = group(SpecDecHead)
    inference: SpecDecInference = group(SpecDecInference)


@dataclass
class Controller:
    granularity: str = key("token: a temperature per token | sequence: one per response",
                           choices=("token", "sequence"))
    grid: list[float] | None = key("temperature grid; must match the rollout folder's", null="the folder's")
    width: int = key("hidden width of the head's MLP", ge=1)
    num_layers: int = key("Linear+SiLU blocks before the output layer (0 = linear head)", ge=0)
    init: str | None = key("a previous round's export to start from", null="a fresh head")


@dataclass
class Lpo:
    form: str = key("separate | joint | latent", choices=("separate", "joint", "latent"))
    beta: float = key("DPO temperature of the logistic loss", gt=0)
    reference: str = key("joint/latent reference policy: uniform | a previous round's controller export")


@dataclass
class AdaptiveTemperature(TrainConfig):
    controller: Controller = group(Controller)
    lpo: Lpo = group(Lpo)


@dataclass
class Diffusion:
    block_length: int = key("tokens per diffusion block", ge=2)
    eps: float = key("t ~ U(eps, 1): share of assistant tokens masked", gt=0, lt=1)
    eot_pad: int = key("EoT slots appended to every row", ge=0)
    random_offset: bool = key("random block phase per row")


@dataclass
class DiffusionAdapt(TrainConfig):
    diffusion: Diffusion = group(Diffusion)


@dataclass
class Filter:
    hidden: int = key("hidden width of the MLP", ge=1)
    num_layers: int = key("MLP layers (1 = logistic regression)", ge=1)
    threshold: float = key("acceptance threshold exported with the filter", gt=0, lt=1)


@dataclass
class Learn2PD(TrainConfig):
    filter: Filter = group(Filter)


SCHEMAS: dict[str, type] = {
    "medusa": Medusa, "medusa2": Medusa2, "hydra": Hydra, "hydra_pp": Hydra, "clover2": Clover2, "eagle": Eagle,
    "eagle3": Eagle3, "dflash": DFlash, "kangaroo": Kangaroo, "specdecpp": SpecDecPP,
    "adaptive_temperature": AdaptiveTemperature, "diffusion_adapt": DiffusionAdapt, "learn2pd": Learn2PD,
}


def register_schemas() -> None:
    """Store every recipe's schema in Hydra's ConfigStore as ``schema/<recipe>`` (conf/train.yaml's first default)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(group="schema", name=name, node=schema)


register_schemas()
