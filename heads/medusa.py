"""Medusa-1 heads: K residual MLP heads on the target's last (post-norm) hidden state.

Head k (0-based) at position t predicts token t+k+2; the target's own LM head predicts t+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.export.exportable import Exportable, ExportContents


@dataclass
class MedusaConfig:
    """Architecture of a set of Medusa heads."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 3
    num_layers: int = 1
    share_lm_head: bool = (
        False  # True: every head reuses the frozen target LM head (Medusa "version 2" layout)
    )
    # Heads score only this many target tokens (the most frequent in the training data; ids in the
    # ``draft_ids`` buffer); None = the whole vocabulary. Each head's LM head is most of a Medusa
    # step's cost, in training and in drafting, so 8k of 49k tokens makes both ~6x cheaper for the
    # few tokens heads could ever propose.
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(
                f"num_heads must be >= 1 and num_layers >= 0, got {self.num_heads},"
                f" {self.num_layers}"
            )
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..{self.vocab_size} (or None for all), "
                f"got {self.draft_vocab_size}"
            )

    @property
    def head_vocab_size(self) -> int:
        """Width of each head's logits: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W zero-initialised so a fresh head starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    """One head: ``num_layers`` ResBlocks, then its own LM head (absent when the target's is
    shared)."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[ResBlock(config.hidden_size) for _ in range(config.num_layers)]
        )
        self.lm_head = (
            None
            if config.share_lm_head
            else nn.Linear(config.hidden_size, config.head_vocab_size, bias=False)
        )

    def forward(self, hidden: torch.Tensor, shared_lm_head: torch.Tensor | None) -> torch.Tensor:
        x = self.blocks(hidden)  # [..., H]
        if self.lm_head is not None:
            return self.lm_head(x)  # [..., V'] (V' = draft vocabulary or V)
        return F.linear(x, shared_lm_head.to(x.dtype))  # [..., V']


class MedusaHeads(Exportable, nn.Module):
    """K Medusa heads; ``forward`` maps hidden [..., H] to logits [K, ..., V'] over
    ``config.head_vocab_size``
    columns: target ids, or with a draft vocabulary the indices into ``draft_ids`` (see
    :meth:`to_target_ids`).

    ``draft_ids`` [V'] (ascending target ids) is required with ``config.draft_vocab_size`` and saved
    with the heads.
    """

    method = "medusa"
    also_loads = ("medusa2",)
    config_class = MedusaConfig
    unexported_keys = ("shared_lm_head",)

    def __init__(
        self,
        config: MedusaConfig,
        lm_head_weight: torch.Tensor | None = None,
        draft_ids: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList([MedusaHead(config) for _ in range(config.num_heads)])
        if config.share_lm_head and lm_head_weight is None:
            raise ValueError("share_lm_head=True needs the target's lm_head_weight")
        if config.draft_vocab_size is not None:
            if draft_ids is None or tuple(draft_ids.shape) != (config.draft_vocab_size,):
                raise ValueError(
                    f"draft_vocab_size={config.draft_vocab_size} needs draft_ids of that length "
                    "(the target id of each draft token), got "
                    f"{None if draft_ids is None else tuple(draft_ids.shape)}"
                )
            if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= config.vocab_size:
                raise ValueError(f"draft_ids must be target ids in 0..{config.vocab_size - 1}")
            self.register_buffer("draft_ids", draft_ids.detach().to(torch.long).clone())
            # target id -> head column (-1 outside the draft vocabulary), derived once: the loss
            # maps labels each step
            index = torch.full((config.vocab_size,), -1, dtype=torch.long)
            index[self.draft_ids] = torch.arange(config.draft_vocab_size)
            self.register_buffer("head_index", index, persistent=False)
        else:
            self.draft_ids = self.head_index = None
        if lm_head_weight is not None:
            if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
                raise ValueError(
                    f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, expected "
                    f"({config.vocab_size}, {config.hidden_size})"
                )
            if self.draft_ids is not None:
                lm_head_weight = lm_head_weight[self.draft_ids.to(lm_head_weight.device)]  # [V', H]
            if config.share_lm_head:
                # A non-persistent buffer: shared, frozen, never saved in checkpoints or exports.
                self.register_buffer("shared_lm_head", lm_head_weight.detach(), persistent=False)
            else:
                with torch.no_grad():
                    for head in self.heads:
                        head.lm_head.weight.copy_(
                            lm_head_weight
                        )  # Medusa-1: each head starts as the target head
        if not config.share_lm_head:
            self.shared_lm_head = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [head(hidden, self.shared_lm_head) for head in self.heads]
        )  # [K, ..., V']

    def to_target_ids(self, head_ids: torch.Tensor) -> torch.Tensor:
        """Column indices of the heads' logits -> target token ids (the identity without a draft
        vocabulary)."""
        return head_ids if self.draft_ids is None else self.draft_ids[head_ids]

    def to_head_ids(self, target_ids: torch.Tensor, missing: int = -100) -> torch.Tensor:
        """Target token ids -> the heads' column indices; ids outside the draft vocabulary become
        ``missing``."""
        if self.head_index is None:
            return target_ids
        head_ids = self.head_index[target_ids]
        return head_ids.masked_fill(head_ids < 0, missing)

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head ``k`` alone (saves compute when only some positions/heads are needed)."""
        return self.heads[k](hidden, self.shared_lm_head)

    def head_parts(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``k`` split at its LM head: (input of the LM head [..., H], LM-head weight [V, H]).

        ``F.linear(*head_parts(h, k))`` equals ``head_logits(h, k)``; training passes the two to a
        fused linear + cross-entropy instead, so the [..., V] logits are never materialised. The
        shared target head is frozen.
        """
        head = self.heads[k]
        weight = head.lm_head.weight if head.lm_head is not None else self.shared_lm_head
        return head.blocks(hidden), weight

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights an export stores (never the shared target head)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("shared_lm_head")}

    @classmethod
    def _build(
        cls,
        architecture: MedusaConfig,
        export: ExportContents,
        lm_head_weight: torch.Tensor | None = None,
    ) -> MedusaHeads:
        """Heads for an export (pass the target LM head when they share it); ``draft_ids`` come from
        the export."""
        return cls(
            architecture,
            lm_head_weight if architecture.share_lm_head else None,
            draft_ids=export.state.get("draft_ids"),
        )
