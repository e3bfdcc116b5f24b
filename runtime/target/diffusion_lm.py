"""A block-diffusion LM served from an ordinary HF causal-LM folder: block masks, loading,
prefix-cached forwards.

Conventions (shared by training, decoding and the oracle):

* The folder's ``config.json`` carries ``draftsmith_diffusion = {"block_length", "mask_token_id",
  "shift"}``; a folder without it is a causal LM and is refused as a diffusion target.
* Attention is bidirectional inside a block and causal across blocks: query ``i`` may read key ``j``
  iff ``block[j] <= block[i]``. The mask is always passed as an explicit 4-D boolean tensor, because
  with SDPA and no padding transformers drops a 2-D mask and Llama attention silently falls back to
  causal.
* Shift (as in DiffuLLaMA/Dream): the logits at position ``i`` score token ``i+1``, so the first
  slot of a block is predicted by the last position of the block before it.

Published diffusion LMs ship their modelling code with the weights (``auto_map`` in
``config.json``), so they load only when the user turns ``trust_remote_code`` on
(``--trust-remote-code``); it is off by default. They attend to the whole canvas
(``attention="full"``): every step scores the prompt, the finished blocks, the current block and the
still-masked later blocks together, with no prefix cache. LLaDA scores slot ``i`` at position ``i``
(no shift); Dream, initialised from Qwen2.5, keeps the shift.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# the format this module serves, named here too
from draftsmith.common.diffusion_format import (  # noqa: F401
    DIFFUSION_KEY,
    MASK_TOKEN,
    REMOTE_BLOCK_LENGTH,
    REMOTE_FAMILIES,
    DiffusionSpec,
    DiffusionTargetError,
    additive_mask,
    block_causal_mask,
    block_ids,
    prompt_offset,
    spec_of,
    supports_prefix_cache,
)
from draftsmith.common.errors import InputError
from draftsmith.export.diffusion_folder import save_diffusion_folder  # noqa: F401


class DiffusionLM:
    """A block-diffusion LM (a HF ``*ForCausalLM`` with bidirectional-in-block attention) for
    decoding.

    ``forward(ids, blocks, cache)`` runs one no-grad forward of the new positions ``ids`` [1, T]
    whose block ids are ``blocks`` [1, T], after the positions already in ``cache`` (a HF
    ``DynamicCache`` or None), and returns the logits [1, T, V] (with the shift, position i scores
    token i+1). ``cache`` is extended only when ``commit=True``.
    """

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, spec: DiffusionSpec, name_or_path: str = ""
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.spec = spec
        self.name_or_path = name_or_path
        self.forwards = 0  # model calls since creation (the bench's "forwards per generated token")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context(self) -> int:
        config = self.model.config  # LLaDA names it max_sequence_length
        return int(
            getattr(config, "max_position_embeddings", None)
            or getattr(config, "max_sequence_length", None)
            or 1 << 30
        )

    def eos_ids(self) -> tuple[int, ...]:
        """Token ids that end a text (the tokenizer's EOS and the config's ``eos_token_id``)."""
        ids = {getattr(self.tokenizer, "eos_token_id", None)}
        eos = getattr(self.model.config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return tuple(sorted(i for i in ids if i is not None))

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        blocks: torch.Tensor,
        cache: Any = None,
        past_blocks: torch.Tensor | None = None,
        commit: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """Logits [1, T, V] of ``ids`` [1, T] at block ids ``blocks`` [1, T] after ``cache`` (block
        ids ``past_blocks`` [1, P]); returns ``(logits, cache)`` with ``cache`` extended by ``ids``
        only when ``commit``.
        """
        from transformers import DynamicCache

        # LLaDA/Dream: the remote model attends to everything it is given
        if self.spec.attention == "full":
            if cache is not None or commit:
                raise InputError(
                    "a full-attention diffusion LM (LLaDA, Dream) has no prefix cache: decode with"
                    " the cache off"
                )
            out = self.model(input_ids=ids)
            self.forwards += 1
            return out.logits.float(), None
        past = 0 if cache is None else cache.get_seq_length()
        # [1, P+T]
        keys = blocks if past_blocks is None else torch.cat([past_blocks, blocks], dim=1)
        if keys.shape[1] != past + ids.shape[1]:
            raise ValueError(
                f"block ids cover {keys.shape[1]} positions but the forward has"
                f" {past + ids.shape[1]}"
            )
        dtype = next(self.model.parameters()).dtype
        mask = additive_mask(
            block_causal_mask(blocks, keys), dtype
        )  # [1, 1, T, P+T]: never the causal fallback
        positions = torch.arange(past, past + ids.shape[1], device=ids.device)[None]  # [1, T]
        work = cache
        if cache is not None and not commit:
            work = _cache_copy(
                cache
            )  # the block is scored, not committed: keep the prefix cache as it was
        elif cache is None and commit:
            work = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=work,
            use_cache=work is not None,
        )
        self.forwards += 1
        return out.logits.float(), (work if commit else cache)


def _cache_copy(cache: Any) -> Any:
    """A shallow copy of a DynamicCache whose layers can be appended to without touching the
    original."""
    import copy

    clone = copy.copy(cache)
    clone.layers = [copy.copy(layer) for layer in cache.layers]
    return clone


def load_diffusion_lm(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> DiffusionLM:
    """Load a block-diffusion target folder (written by ``recipe=diffusion_adapt``); a causal LM is
    refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.assets import resolve_target

    path = Path(resolve_target(str(name_or_path)))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DiffusionTargetError(
            f"{path} has no config.json: pass a HF model folder written by "
            "`draftsmith diffusion-export` or by recipe=diffusion_adapt"
        )
    raw = json.loads(config_file.read_text())
    if raw.get("format") == "draftsmith":
        raise DiffusionTargetError(
            f"{path} is a draftsmith export, not a HF model folder; convert it with "
            f"`draftsmith diffusion-export {path} --out {path}-hf` and pass that folder"
        )
    spec = spec_of(raw, where=str(path))
    auto_map = raw.get("auto_map") or {}
    if spec.attention == "full" and not trust_remote_code:
        raise DiffusionTargetError(
            f"{path} is a {raw.get('model_type')} model whose modelling code ships with the weights"
            " (config.json auto_map); loading it runs that code, so it is off by default: pass"
            " --trust-remote-code to allow it"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if "AutoModelForCausalLM" in auto_map or not auto_map:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
    else:  # Dream registers its LM (with the head) under AutoModel only
        from transformers import AutoModel

        model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and spec.mask_token_id >= embeddings.weight.shape[0]:
        raise DiffusionTargetError(
            f"{path}: mask token id {spec.mask_token_id} is outside the embedding table"
        )
    return DiffusionLM(model.to(device), tokenizer, spec, str(name_or_path))


def folder_from_export(source: str | Path, out_dir: str | Path) -> Path:
    """Rebuild the HF folder of a ``recipe=diffusion_adapt`` export (``<run dir>/export`` or the run
    folder): config from the export's architecture, weights from ``model.safetensors``, the base
    tokenizer plus the mask token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from draftsmith.assets import resolve_target
    from draftsmith.export.format import read_export

    source = Path(source)
    if not (source / "config.json").is_file() and (source / "export" / "config.json").is_file():
        source = source / "export"
    raw = (
        json.loads((source / "config.json").read_text())
        if (source / "config.json").is_file()
        else {}
    )
    if DIFFUSION_KEY in raw and raw.get("format") != "draftsmith":
        raise DiffusionTargetError(
            f"{source} is already a block-diffusion HF folder (recipe=diffusion_adapt writes "
            f"one): pass it as the target directly, e.g. `--target {source}`"
        )
    config, state = read_export(source)
    if config.get("method") != "diffusion_adapt":
        raise DiffusionTargetError(
            f"{source} is a {config.get('method')!r} export, not a recipe=diffusion_adapt one"
        )
    arch = config["architecture"]
    hf = dict(arch["hf_config"])
    spec = spec_of(hf, where=str(source))
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[hf.pop("model_type")].from_dict(hf))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("lm_head.")]:
        raise DiffusionTargetError(
            f"{source}: weights do not fit the recorded config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    base = arch.get("base_tokenizer") or config["target"]["name_or_path"]
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(str(base)))
    if MASK_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    if tokenizer.convert_tokens_to_ids(MASK_TOKEN) != spec.mask_token_id:
        raise DiffusionTargetError(
            f"the tokenizer of {base} gives {MASK_TOKEN} another id than the trained "
            f"{spec.mask_token_id}; it is not the tokenizer the model was adapted with"
        )
    return save_diffusion_folder(
        model, tokenizer, spec, out_dir, extra={"trained": config.get("training", {})}
    )


__all__ = [
    "folder_from_export",
    "DIFFUSION_KEY",
    "MASK_TOKEN",
    "REMOTE_FAMILIES",
    "DiffusionLM",
    "DiffusionSpec",
    "DiffusionTargetError",
    "additive_mask",
    "block_causal_mask",
    "block_ids",
    "load_diffusion_lm",
    "prompt_offset",
    "save_diffusion_folder",
    "spec_of",
    "supports_prefix_cache",
]
