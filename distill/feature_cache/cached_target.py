"""The target as a feature cache knows it (:class:`CachedTarget`): a
:class:`~draftsmith.distill.target.frozen.TargetModel` stand-in holding the target's config,
tokenizer, embedding and LM head from the cache's ``target/`` folder; its features come with each
cached batch (logits and top-k rebuilt from the final hidden state with the stored LM head).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.distill.feature_cache.cached_data import REBUILD, FeatureCache
from draftsmith.distill.feature_cache.manifest import (
    HEAD_FILE,
    PREFIX,
    TARGET_DIR,
    FeatureCacheError,
)
from draftsmith.distill.target.features import FeatureTaps, TargetFeatures


class CachedTarget:
    """The target as a feature cache knows it: config, tokenizer, embedding and LM head; features
    per batch."""

    def __init__(self, cache: FeatureCache) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoTokenizer

        folder = cache.path / TARGET_DIR
        self.cache = cache
        try:
            self.config = AutoConfig.from_pretrained(folder)
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self._weights = load_file(
                str(folder / HEAD_FILE)
            )  # embed, lm_head [V, H] in the target's dtype
        # transformers and tokenizers raise many types for a damaged file
        except Exception as err:  # noqa: BLE001
            raise FeatureCacheError(
                f"feature cache {cache.path}: its {TARGET_DIR}/ folder does not load "
                f"({' '.join(str(err).split())[:200]}); {REBUILD}"
            ) from None
        self.name_or_path = str(cache.manifest["target"]["name_or_path"])
        self.stored = FeatureTaps(
            **{**cache.manifest["taps"], "layers": tuple(cache.manifest["taps"]["layers"])}
        )

    hidden_size = property(lambda self: int(self.config.hidden_size))
    vocab_size = property(lambda self: int(self._weights["lm_head"].shape[0]))
    num_layers = property(lambda self: int(self.config.num_hidden_layers))
    lm_head_weight = property(lambda self: self._weights["lm_head"])
    embed_weight = property(lambda self: self._weights["embed"])

    def identity(self) -> dict:
        """The identity of the target the cache was built with (recorded in exports)."""
        return dict(self.cache.manifest["target"])

    def to(self, *args: Any, **kwargs: Any) -> CachedTarget:
        self._weights = {k: v.to(*args, **kwargs) for k, v in self._weights.items()}
        return self

    def check_taps(self, taps: FeatureTaps, own_features: bool = False) -> None:
        """Refuse an objective that needs features the cache does not hold (before training
        starts)."""
        missing = [f"layer {i}" for i in taps.layers if i not in self.stored.layers]
        missing += ["prenorm_hidden"] * (taps.prenorm_hidden and not self.stored.prenorm_hidden)
        if own_features or missing:
            what = (
                "computes its own target features"
                if own_features
                else f"needs {', '.join(missing)}"
            )
            raise FeatureCacheError(
                f"feature cache {self.cache.path} holds {self.cache.manifest['features']} but the "
                f"objective {what} (another recipe or drafter.target_layers?); {REBUILD}"
            )

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        taps: FeatureTaps | None = None,
    ) -> TargetFeatures:
        raise FeatureCacheError(
            "a feature-cache target has no model to run: its features come with each cached "
            "batch (DistillModule reads them with batch_features)"
        )

    def batch_features(
        self, batch: dict[str, torch.Tensor], taps: FeatureTaps
    ) -> tuple[TargetFeatures, dict[str, torch.Tensor]]:
        """The cached features of ``batch`` (logits / top-k rebuilt with the LM head) and the batch
        without them."""
        self.check_taps(taps)
        dtype = self.lm_head_weight.dtype  # what the online target returned its features in
        greedy = batch.get(PREFIX + "greedy_ids")
        got = {
            k[len(PREFIX) :]: v.to(dtype)
            for k, v in batch.items()
            if k.startswith(PREFIX) and k[len(PREFIX) :] != "greedy_ids"
        }
        feats = TargetFeatures(
            final_hidden=got["final_hidden"] if taps.final_hidden else None,
            prenorm_hidden=got.get("prenorm_hidden") if taps.prenorm_hidden else None,
            layer_hidden={i: got[f"layer.{i}"] for i in taps.layers},
        )
        if taps.logits and taps.lazy_logits and greedy is not None and not taps.topk:
            # only the rows the objective asks for go through the LM head (TargetFeatures.logits_at)
            feats.final_hidden, feats.greedy_ids, feats.head_weight = (
                got["final_hidden"],
                greedy,
                self.lm_head_weight,
            )
        elif taps.logits or taps.topk:
            logits = F.linear(
                got["final_hidden"], self.lm_head_weight
            )  # [B, T, V], as the target's lm_head
            feats.logits = logits if taps.logits else None
            if taps.topk:
                feats.topk_values, feats.topk_indices = logits.topk(taps.topk, dim=-1)
        return feats, {k: v for k, v in batch.items() if not k.startswith(PREFIX)}
