"""The frozen target model and its feature taps.

Alignment conventions of the taps (the off-by-one shift is the commonest bug in this field; how
EAGLE pairs these features with tokens is stated once, in drafters/eagle.py):

* Every tap is indexed by input position ``t``: ``final_hidden[:, t]`` is the state after reading
  ``input_ids[:, :t+1]``; the target's LM head applied to it predicts token ``t+1``.
* ``final_hidden`` is AFTER the final RMSNorm (the tensor fed to ``lm_head``; HF
  ``hidden_states[-1]``). Medusa/Hydra heads and EAGLE-1 regress/consume this one.
* ``prenorm_hidden`` is the residual stream after the last decoder layer, BEFORE the final norm.
* ``layers=(i, ...)`` returns HF ``hidden_states[i]``: index 0 is the embedding output, index ``i >=
  1`` is the output of decoder layer ``i-1`` == the input of decoder layer ``i`` (pre-norm residual
  stream). EAGLE-3's "inputs of layers 2, L//2, L-3" are therefore ``layers=(2, L//2, L-3)``.
* ``logits`` / ``topk`` are the target's next-token logits at each position (predicting token
  ``t+1``), exactly ``model(ids).logits``: the model's own forward computes them, with its LM-head
  post-processing (Gemma-2 final logit softcapping, Granite ``logits_scaling``, Cohere
  ``logit_scale``, a head bias).

Loading it (its dtype, the checks of a model folder): :mod:`.loading`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from draftsmith.common.constants import ADAPTER_LORA
from draftsmith.common.errors import ConfigError
from draftsmith.distill.target.features import (
    FeatureTaps,
    TargetFeatures,
)  # the taps' home, re-exported here
from draftsmith.distill.target.loading import load_causal_lm
from draftsmith.distill.target.lora import LoraSpec, TargetAdapter, lora_module_paths, require_peft
from draftsmith.distill.target.static_forward import forward_inputs, head_argmax, plain_lm_head
from draftsmith.export.identity import target_identity

DEFAULT_TAPS = FeatureTaps()  # the final hidden state only


@runtime_checkable
class TargetModel(Protocol):
    """What recipes and the LightningModule need of a frozen target. :class:`Target` (a causal LM)
    is one implementation; a masked-diffusion LM is another kind to come. It is never saved into
    checkpoints or hparams, and its own weights are never optimised. A trainable adapter
    (:meth:`Target.attach_lora`) is a submodule of the target that the objective's module registers
    too: it is the objective's module that trains and saves it.
    """

    tokenizer: Any
    name_or_path: str

    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def lm_head_weight(self) -> torch.Tensor: ...
    @property
    def embed_weight(self) -> torch.Tensor: ...
    def identity(self) -> dict: ...
    def to(self, *args: Any, **kwargs: Any) -> Any: ...
    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        taps: FeatureTaps | None = None,
    ) -> TargetFeatures: ...


class Target(nn.Module):
    """A frozen HF causal LM (the :class:`TargetModel` every recipe uses today): eval mode, no
    gradients, never saved into checkpoints or hparams."""

    def __init__(self, model: nn.Module, tokenizer, name_or_path: str) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        self.adapter: TargetAdapter | None = None  # a trainable LoRA, when a recipe attaches one

    @classmethod
    def load(
        cls,
        name_or_path: str,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
        runs_on: str | torch.device | None = None,
    ) -> Target:
        """Load a HF causal LM folder (or hub name, if the user allows the network) as a frozen
        target.

        ``dtype`` is ``auto`` | ``bf16`` | ``fp16`` | ``fp32``; ``auto`` is resolved for ``runs_on``
        (the device the trainer will move the target to; default ``device``) and the choice is
        logged with its reason.
        """
        runs_on = runs_on if runs_on is not None else device
        model, tokenizer = load_causal_lm(name_or_path, dtype, runs_on, trust_remote_code)
        return cls(model.to(device), tokenizer, str(name_or_path))

    @property
    def config(self):
        """The HF config of the target."""
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """Frozen LM head weight [V, H] (read-only; shared with drafters that reuse it)."""
        return self.model.get_output_embeddings().weight

    @property
    def embed_weight(self) -> torch.Tensor:
        """Frozen token embedding [V, H]."""
        return self.model.get_input_embeddings().weight

    def identity(self) -> dict:
        """Identity recorded in exports: name, sizes and a fingerprint of tokenizer + LM head; with
        an adapter attached, also ``adapter: {kind, fingerprint}`` of its current weights."""
        ident = target_identity(self.name_or_path, self.config, self.tokenizer, self.lm_head_weight)
        if self.adapter is not None:
            ident["adapter"] = {"kind": ADAPTER_LORA, "fingerprint": self.adapter.fingerprint()}
        return ident

    def attach_lora(self, spec: LoraSpec) -> TargetAdapter:
        """Inject trainable LoRA adapters (peft) into the target's linears named by
        ``spec.target_modules``.

        The adapter becomes the registered submodule ``self.adapter``; the rest of the target stays
        frozen. Raises ConfigError when peft is missing, an adapter is already attached, or no
        linear matches.
        """
        peft = require_peft("a LoRA adapter on the target (recipe=medusa2)")
        if self.adapter is not None:
            raise ConfigError("the target already carries an adapter")
        paths = lora_module_paths(self.model, spec.target_modules)
        config = peft.LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=paths,
            bias="none",
        )
        peft.inject_adapter_in_model(config, self.model)
        layers = {}
        for name, module in self.model.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer) and "default" in module.lora_A:
                layers[name] = (module.lora_A["default"], module.lora_B["default"])
        if sorted(layers) != sorted(paths):
            raise ConfigError(
                f"peft adapted {len(layers)} modules, expected {len(paths)}: {sorted(layers)[:3]}"
            )
        # fp32 adapter weights on a bf16/fp16 target: the optimizer then updates fp32 values (peft
        # casts the layer's input to the adapter's dtype and the result back).
        self.adapter = TargetAdapter(spec, layers).float()
        return self.adapter

    @contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Run the original target (Medusa-2's self-distillation teacher: the same model, no second
        copy)."""
        if self.adapter is None:
            yield
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)  # also re-enables the adapter weights' gradients

    def train(self, mode: bool = True) -> Target:
        # Lightning calls .train() on the whole module tree; the target must stay in eval mode.
        return super().train(False)

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        taps: FeatureTaps = DEFAULT_TAPS,
        grad: bool = False,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> TargetFeatures:
        """One forward returning the requested taps (input_ids [B, T]); no-grad unless ``grad`` (a
        trainable adapter: the taps then carry the graph back to it, where gradients are enabled at
        all). Packed rows pass their ``document_ids`` and ``position_ids`` [B, T]: attention stays
        inside each document (4-D mask).
        """
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            inputs = forward_inputs(
                input_ids, attention_mask, position_ids, document_ids, self.lm_head_weight.dtype
            )
            return self._features(inputs, taps)

    def lazy_head(self, taps: FeatureTaps) -> bool:
        """Whether ``taps`` get the greedy ids and the LM head instead of the [B, T, V] logits: an
        objective that reads logits lazily (EAGLE-3) on a plain head without an adapter."""
        return bool(
            taps.logits
            and taps.lazy_logits
            and not taps.topk
            and self.adapter is None
            and plain_lm_head(self.model)
            and self.lm_head_weight.numel() > 0
        )  # not a ZeRO-3 placeholder

    def _features(self, inputs: dict[str, Any], taps: FeatureTaps) -> TargetFeatures:
        backbone = (
            self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        )
        captured: dict[str, torch.Tensor] = {}
        hook = None
        if taps.prenorm_hidden:
            # HF returns the post-norm state as the last hidden state; the pre-norm residual stream
            # is the final norm's input, captured with a forward pre-hook.
            hook = backbone.norm.register_forward_pre_hook(
                lambda _m, args: captured.__setitem__("pre", args[0])
            )
        lazy = self.lazy_head(taps)
        want_logits = bool(taps.logits or taps.topk) and not lazy
        try:
            if want_logits:
                # The model's own forward, so its LM-head post-processing applies (see the module
                # docstring).
                from draftsmith.common.hf_forward import hf_forward

                out, logits = hf_forward(
                    self.model,
                    backbone,
                    0,
                    **inputs,
                    output_hidden_states=bool(taps.layers),
                    use_cache=False,
                )
            else:
                out = backbone(**inputs, output_hidden_states=bool(taps.layers), use_cache=False)
        finally:
            if hook is not None:
                hook.remove()
        final = out.last_hidden_state  # [B, T, H], after the final norm
        feats = TargetFeatures(
            final_hidden=final if taps.final_hidden or lazy else None,
            prenorm_hidden=captured.get("pre"),
        )
        for i in taps.layers:
            if not 0 <= i < self.num_layers:
                raise ConfigError(
                    f"layer tap {i} out of range 0..{self.num_layers - 1} (HF hidden_states index; "
                    "use prenorm_hidden/final_hidden for the last layer's output)"
                )
            feats.layer_hidden[i] = out.hidden_states[i]  # [B, T, H]
        # the greedy ids in row chunks; logits of chosen rows and entries on demand (draft_logits)
        if lazy:
            feats.head_weight = self.lm_head_weight
            feats.greedy_ids = head_argmax(final, self.lm_head_weight)  # [B, T]
        elif want_logits:  # logits [B, T, V]
            if taps.logits:
                feats.logits = logits
            if taps.topk:
                feats.topk_values, feats.topk_indices = logits.topk(taps.topk, dim=-1)
        return feats
