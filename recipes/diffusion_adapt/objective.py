"""Adapt a causal LM into a BD3LM-style block-diffusion LM (DiffuLLaMA/Dream shift, MDLM 1/t loss,
block 32).

The objective's ``module`` is the HF model being adapted (a copy of the target with a ``<|mask|>``
token added), so the one DistillModule trains it like any drafter; the frozen target is never run
(``features`` returns None).

Training uses two streams (BD3LM): the noisy copy ``x_t`` and the clean copy ``x_0`` side by side,
same positions. A noisy query reads the noisy keys of its own block and the clean keys of earlier
blocks; a clean query reads clean keys of its own and earlier blocks. That is exactly what decoding
sees (clean finished blocks, one noisy block), without a forward per block. With the shift, token
``j`` is scored by the hidden state at ``j-1``: the noisy one inside a block, the clean one when
``j`` opens a block (its predictor sits in the finished block before it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.diffusion_format import (
    DIFFUSION_KEY,
    MASK_TOKEN,
    DiffusionSpec,
    additive_mask,
)
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.export.diffusion_folder import save_diffusion_folder
from draftsmith.recipes.diffusion_adapt import DiffusionAdapt


class DiffusionAdapter(nn.Module):
    """The HF causal LM being adapted. Its state dict leaves out a tied LM head (safetensors refuses
    shared tensors; the embedding holds it) and loading puts it back."""

    def __init__(self, model: nn.Module, spec: DiffusionSpec, tokenizer: Any) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        object.__setattr__(
            self, "tokenizer", tokenizer
        )  # saved with the HF folder, not in the state dict
        self._tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self._register_state_dict_hook(DiffusionAdapter._drop_tied)
        self.register_load_state_dict_pre_hook(DiffusionAdapter._restore_tied)

    @staticmethod
    def _drop_tied(module: DiffusionAdapter, state: dict, prefix: str, _meta: Any) -> None:
        if module._tied:
            state.pop(f"{prefix}model.lm_head.weight", None)

    @staticmethod
    def _restore_tied(module: DiffusionAdapter, state: dict, prefix: str, *_args: Any) -> None:
        embed = f"{prefix}model.model.embed_tokens.weight"
        if module._tied and embed in state:
            state.setdefault(f"{prefix}model.lm_head.weight", state[embed])

    def architecture(self) -> dict[str, Any]:
        """The export's architecture block: the HF config (with the diffusion spec) to rebuild the
        folder from."""
        config = self.model.config.to_dict()
        config[DIFFUSION_KEY] = self.spec.to_dict()
        return {
            "hf_config": config,
            "base_tokenizer": str(getattr(self.tokenizer, "name_or_path", "")),
            "mask_token": MASK_TOKEN,
            **self.spec.to_dict(),
        }


def two_stream_mask(blocks: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Attention mask [B, 1, 2T, 2T] over ``[x_t ; x_0]`` from block ids [B, T] and the valid-token
    mask [B, T]."""
    q, k = blocks[:, :, None], blocks[:, None, :]  # [B, T, 1], [B, 1, T]
    noisy_noisy, noisy_clean, clean_clean = k == q, k < q, k <= q  # [B, T, T] each
    none = torch.zeros_like(clean_clean)
    mask = torch.cat(
        [torch.cat([noisy_noisy, noisy_clean], 2), torch.cat([none, clean_clean], 2)], 1
    )  # [B, 2T, 2T]
    keys_ok = valid.bool().repeat(1, 2)  # [B, 2T]
    eye = torch.eye(
        mask.shape[1], dtype=torch.bool, device=mask.device
    )  # a padded row still reads itself: no NaN
    return ((mask & keys_ok[:, None, :]) | eye)[:, None]  # [B, 1, 2T, 2T]


def pad_with_eot(
    ids: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor, eot: int, extra: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill each row's padding and ``extra`` more slots with EoT tokens that count in the loss
    (LLaDA SFT), so the model learns that everything after the end of text is EoT. Returns ids and
    loss mask [B, T+extra].
    """
    B, T = ids.shape
    ids = torch.cat([ids, ids.new_full((B, extra), eot)], 1)  # [B, T+extra]
    tail = torch.cat(
        [~valid.bool(), valid.new_ones((B, extra), dtype=torch.bool)], 1
    )  # [B, T+extra]
    ids = torch.where(tail, torch.full_like(ids, eot), ids)
    loss_mask = torch.cat([loss_mask.bool() & valid.bool(), tail[:, T:]], 1) | tail
    return ids, loss_mask


class DiffusionAdaptObjective(Objective):
    """Masked-token CE weighted by 1/t, t ~ U(eps, 1), on assistant tokens (and the EoT padding)."""

    batch_kind = "chat"
    taps = FeatureTaps(final_hidden=False)

    def __init__(
        self,
        adapter: DiffusionAdapter,
        eps: float,
        eot_id: int,
        eot_pad: int,
        random_offset: bool = True,
    ) -> None:
        self.module = adapter
        self.eps, self.eot_id, self.eot_pad, self.random_offset = (
            eps,
            eot_id,
            eot_pad,
            random_offset,
        )

    def features(self, target: Any, batch: dict[str, torch.Tensor]) -> None:
        return None  # the module is the model: no frozen-target forward

    def loss(
        self, batch: dict[str, torch.Tensor], feats: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One two-stream forward; CE at the masked positions, weighted 1/t and normalised by the
        loss tokens."""
        spec, model = self.module.spec, self.module.model
        ids, loss_mask = pad_with_eot(
            batch["input_ids"],
            batch["attention_mask"],
            batch["loss_mask"],
            self.eot_id,
            self.eot_pad,
        )  # [B, T]
        B, T = ids.shape
        device = ids.device
        t = self.eps + (1 - self.eps) * torch.rand(B, device=device)  # [B]
        noised = (torch.rand(B, T, device=device) < t[:, None]) & loss_mask
        noised[:, 0] = False  # token 0 has no predecessor to score it
        xt = torch.where(noised, torch.full_like(ids, spec.mask_token_id), ids)
        # A random block phase per row: decoding aligns blocks to the prompt's end, wherever that
        # falls.
        offset = (
            torch.randint(0, spec.block_length, (B, 1), device=device) if self.random_offset else 0
        )
        blocks = (torch.arange(T, device=device)[None] + offset) // spec.block_length  # [B, T]
        valid = torch.ones_like(ids, dtype=torch.bool)
        positions = torch.arange(T, device=device).repeat(2)[None].expand(B, -1)  # [B, 2T]
        hidden = model.get_decoder()(
            input_ids=torch.cat([xt, ids], 1),
            attention_mask=additive_mask(two_stream_mask(blocks, valid), model.dtype),
            position_ids=positions,
            use_cache=False,
        ).last_hidden_state  # [B, 2T, H]
        b, j = noised.nonzero(as_tuple=True)  # [N] each: the masked slots
        opens_block = blocks[b, j] != blocks[b, j - 1]
        source = torch.where(
            opens_block, T + j - 1, j - 1
        )  # clean predictor for a block's first slot
        logits = model.lm_head(hidden[b, source]).float()  # [N, V]
        ce = F.cross_entropy(logits, ids[b, j], reduction="none")  # [N]
        loss = (ce / t[b]).sum() / loss_mask.sum().clamp(min=1)
        with torch.no_grad():
            metrics = {
                "masked_acc": (
                    (logits.argmax(-1) == ids[b, j]).float().mean() if len(j) else ce.sum()
                ),
                "masked_ce": ce.mean() if len(j) else ce.sum(),
                "mask_rate": t.mean(),
            }
        return loss, metrics

    def write_export(self, out_dir: Any, training: dict[str, Any]) -> Any:
        """The export as an ordinary HF folder (``export_from_module`` calls this instead of the
        draftsmith format)."""
        return save_diffusion_folder(
            self.module.model,
            self.module.tokenizer,
            self.module.spec,
            out_dir,
            extra={"trained": training},
        )

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "diffusion_adapt",
            "architecture": self.module.architecture(),
            "inference": {"block_length": self.module.spec.block_length},
        }


def add_mask_token(model: nn.Module, tokenizer: Any) -> int:
    """Add ``<|mask|>`` to the tokenizer and the (tied) embeddings, initialised at the mean
    embedding; its id."""
    if MASK_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    mask_id = int(tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    old = model.get_input_embeddings().weight.shape[0]
    if mask_id >= old:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb[old:] = emb[:old].mean(0)
    return mask_id


def build(cfg: DiffusionAdapt, target: Target) -> DiffusionAdaptObjective:
    """A trainable fp32 copy of the target with a mask token; the frozen target itself is left
    untouched."""
    from draftsmith.common.diffusion_format import spec_of

    if getattr(target.config, DIFFUSION_KEY, None):
        spec_of(target.config)  # already a diffusion model: continue adapting with its own spec
    model = copy.deepcopy(target.model).float().train().requires_grad_(True)
    tokenizer = copy.deepcopy(target.tokenizer)
    mask_id = add_mask_token(model, tokenizer)
    spec = DiffusionSpec(cfg.diffusion.block_length, mask_id)
    setattr(model.config, DIFFUSION_KEY, spec.to_dict())
    eot = (
        tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    )
    return DiffusionAdaptObjective(
        DiffusionAdapter(model, spec, tokenizer),
        cfg.diffusion.eps,
        int(eot),
        cfg.diffusion.eot_pad,
        cfg.diffusion.random_offset,
    )
