"""The drafter adapters the EAGLE proposer (runtime/drafting/eagle.py) drafts through: EAGLE-1 and EAGLE-3."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from draftsmith.common.layers import KVCache, build_attention_mask, default_positions
from draftsmith.drafters.eagle import EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter


class DraftModel(Protocol):
    """What the proposer needs from a drafter (adapters below; tests use stubs)."""

    feature_taps: tuple[int, ...]  # target layer taps to feed; () = the post-norm final hidden
    vocab_size: int  # target vocabulary
    draft_ids: torch.Tensor | None  # target id of each draft-vocab id [N], None = same vocabulary

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [S, F] -> drafter input hidden [1, S, H]."""
        ...

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None,
             tree_mask: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """hidden [1, S, H], target ids [1, S] -> (out [1, S, H], logits [1, S or 1, N], cache)."""
        ...


class Eagle1DraftModel:
    """EAGLE-1 adapter: features are the target's post-norm hidden; logits through the target's LM head."""

    feature_taps: tuple[int, ...] = ()
    draft_ids = None

    def __init__(self, drafter: EagleDrafter, head: Any = None) -> None:
        self.drafter = drafter.eval()
        self.vocab_size = drafter.config.vocab_size
        self.head = head or drafter.logits  # the target's own (packed, faster) head when it offers one

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        return feats[None]  # [1, S, H]

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None,
             tree_mask: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        out, cache = self.drafter(ids, hidden, past_kv=cache, positions=positions, tree_mask=tree_mask)  # [1, S, H]
        return out, self.head(out[:, -1:] if last_only else out), cache  # the V-wide head on needed rows


class Eagle3DraftModel:
    """EAGLE-3 adapter: features are the fused layer taps; own LM head over the draft vocabulary."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter.eval()
        self.feature_taps = tuple(drafter.config.target_layers)
        self.vocab_size = drafter.config.vocab_size
        full = drafter.config.draft_vocab_size == drafter.config.vocab_size
        self.draft_ids = None if full else drafter.draft_ids_in_target()  # [N]

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        return self.drafter.fuse(feats[None])  # [1, S, k*H] -> [1, S, H]

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None,
             tree_mask: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        # Eagle3Drafter.draft_step without its head: the root step feeds every pending prompt row, but only the
        # last one drafts, so only that row (or the frontier rows of a tree step) goes through norm + lm_head.
        d = self.drafter
        past = 0 if cache is None else cache.length
        if positions is None:
            positions = default_positions(1, ids.shape[1], past, ids.device)  # [1, S]
        # One new query sees every key: no mask to build (SDPA without one gives the same output, and faster).
        one_query = ids.shape[1] == 1 and tree_mask is None
        mask = None if one_query else build_attention_mask(ids.shape[1], past, ids.device, tree_mask)  # [1,1,S,P+S]
        emb = F.embedding(ids, d.embed_weight).to(d.fc.weight.dtype)  # [1, S, H]
        out, cache = d.layer(emb, hidden, positions, mask, cache)  # [1, S, H]
        return out, d.logits(out[:, -1:] if last_only else out), cache  # [1, 1 or S, N]


__all__ = ["DraftModel", "Eagle1DraftModel", "Eagle3DraftModel"]
