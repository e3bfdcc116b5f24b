"""A DFlash export with draftsmith's Markov and/or confidence head is DSpark-shaped: write it as
speculators 0.9.0's ``dspark`` type (``--format speculators``) and, for llama.cpp's ``--spec-type
draft-dspark``, as a DeepSpec-style ``Qwen3DSparkModel`` folder (``--format gguf``), instead of
leaving the heads out.

The DFlash body (every ``fc``/``hidden_norm``/``layers.*``/``norm`` tensor, the aux ids, block size
and mask token) is written exactly as ``export/dflash.py`` writes it. The heads, draftsmith ->
speculators (``models/dspark``: ``MarkovHead``, ``ConfidenceHead``; ``sample_from_anchor: false``,
draftsmith's convention: slot ``k`` predicts the token at ``a+k`` and the previous token of slot
``k`` is ``t_{k-1}``, ``t_0`` the verified token):

* Markov. draftsmith adds ``up(down(E[t_{k-1}]))`` to slot ``k``'s LM-head input, i.e. ``L @ U @ D @
  E[t_{k-1}]`` to its logits (``E`` the target embedding [V, H], ``L`` its LM head [V, H], ``D`` =
  ``markov_head.down.weight`` [r, H], ``U`` = ``markov_head.up.weight`` [H, r]). speculators'
  vanilla head adds ``W2 @ W1[t_{k-1}]``. So ``markov_head.markov_w1.weight`` = ``E @ D^T`` [V, r]
  and ``markov_head.markov_w2.weight`` = ``L @ U`` [V, r], with ``markov_rank`` = r: the same logits
  up to float rounding (tests/test_dspark_export.py checks it).
* Confidence. draftsmith's head is ``Linear(2H -> 1)`` over ``concat(norm(h_k) + U D E[t_{k-1}],
  E[t_k])`` (the LM-head input and the embedding of the drafted token); speculators' is ``Linear(H
  [+ r] -> 1)`` over ``concat(norm(h_k), W1[t_{k-1}])`` (with the Markov head) or ``norm(h_k)``.
  Writing ``w = [w_h, w_t]``: ``confidence_head.proj.weight`` = ``[w_h, w_h @ U]`` (with Markov;
  ``[w_h]`` without), ``proj.bias`` = the bias: exact for the LM-head-input part. The drafted-token
  term ``w_t . E[t_k]`` has no slot in speculators' head and is left out: the engines' confidence is
  then an approximation of draftsmith's; its size is recorded
  (``draftsmith.confidence_dropped_term_norm``) and logged.

The speculators/DeepSpec DSpark heads read the target's embedding and LM head, which draftsmith
exports never store: they come from the verifier folder (or are passed in). llama.cpp: the DeepSpec
layout is the z-lab DFlash layout (``dflash_config.target_layer_ids`` = taps - 1, which llama.cpp's
DFlash converter reads) plus the DSpark fields at the top level (``target_layer_ids``,
``block_size``, ``mask_token_id``, ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``) and the head tensors under speculators'
names.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.common.dtypes import dtype_from_name
from draftsmith.export.dflash import (
    _arch_int,
    check_dflash,
    dflash_key_names,
    zlab_config,
    zlab_layer_ids,
)
from draftsmith.export.format import WEIGHTS_FILE, ExportError, atomic_folder_write, read_export
from draftsmith.export.speculators_dflash import speculators_dflash_config
from draftsmith.export.verifier import local_embedding, verifier_architectures

log = logging.getLogger(__name__)

HEAD_PREFIXES = ("confidence_head.", "markov_head.")
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"


def has_dspark_heads(export_dir: str | Path) -> bool:
    """Whether the export's weights hold a Markov or confidence head (reads the safetensors header
    only)."""
    with safe_open(str(Path(export_dir) / WEIGHTS_FILE), framework="pt") as handle:
        return any(k.startswith(HEAD_PREFIXES) for k in handle.keys())


def local_lm_head(folder: str | Path) -> torch.Tensor | None:
    """The LM head [V, H] of a local HF folder (its input embedding when it ties them), or None."""
    config_path = Path(folder).expanduser() / "config.json"
    if not config_path.is_file():
        return None
    tied = bool(json.loads(config_path.read_text()).get("tie_word_embeddings", False))
    path = Path(folder).expanduser() / "model.safetensors"
    if not tied and path.is_file():
        with safe_open(str(path), framework="pt") as handle:
            if "lm_head.weight" in handle.keys():
                return handle.get_tensor("lm_head.weight")
    return local_embedding(str(folder)) if tied else None


def head_tensors(
    state: dict[str, torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
    """(speculators' head tensors, their config fields, norm of the dropped confidence term) (module
    docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    markov = "markov_head.down.weight" in state
    confidence = "confidence_head.weight" in state
    fields = {
        "markov_rank": 0,
        "markov_head_type": "vanilla",
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": confidence and markov,
    }
    up = None
    if markov:
        down, up = (
            state["markov_head.down.weight"].float(),
            state["markov_head.up.weight"].float(),
        )  # [r, H], [H, r]
        tensors["markov_head.markov_w1.weight"] = embed.float() @ down.T  # [V, r]
        tensors["markov_head.markov_w2.weight"] = lm_head.float() @ up  # [V, r]
        fields["markov_rank"] = int(down.shape[0])
    dropped = 0.0
    if confidence:
        weight = state["confidence_head.weight"].float()  # [1, 2H]
        hidden = weight.shape[1] // 2
        w_head, w_token = weight[:, :hidden], weight[:, hidden:]  # [1, H] each
        parts = [w_head] + ([w_head @ up] if up is not None else [])  # [1, H] (+ [1, r])
        tensors["confidence_head.proj.weight"] = torch.cat(parts, dim=1)
        tensors["confidence_head.proj.bias"] = state["confidence_head.bias"].float()
        dropped = float(w_token.norm())
    return tensors, fields, dropped


def _dspark_parts(
    export_dir: str | Path,
    verifier: str,
    source: str | Path,
    embed: torch.Tensor | None,
    lm_head: torch.Tensor | None,
    dtype: str | None,
):
    """(export config, body + head tensors, head fields, dropped-term norm, written dtype)."""
    config, state = read_export(export_dir)
    check_dflash(config, source)
    arch = config["architecture"]
    shape = (_arch_int(arch, "vocab_size"), _arch_int(arch, "hidden_size"))
    embed = embed if embed is not None else local_embedding(verifier)
    lm_head = lm_head if lm_head is not None else local_lm_head(verifier)
    if (
        embed is None
        or lm_head is None
        or tuple(embed.shape) != shape
        or tuple(lm_head.shape) != shape
    ):
        raise ExportError(
            f"{source}: the DSpark heads are written in the target's vocabulary, which needs the"
            f" target's embedding and LM head {shape}: pass --target with the local folder of the"
            f" model the drafter was trained for ({verifier!r} gives none of that shape)"
        )
    names = dflash_key_names(_arch_int(arch, "num_layers", "num_hidden_layers"))
    unknown = [k for k in state if k not in names and not k.startswith(HEAD_PREFIXES)]
    missing = [k for k in names if k not in state]
    if unknown or missing:
        raise ExportError(
            f"{source}: DFlash weights do not match the expected layout (missing {missing[:4]}, "
            f"unexpected {unknown[:4]}); re-export with this draftsmith version"
        )
    heads, fields, dropped = head_tensors(state, embed, lm_head)
    tensors = {**{k: state[k].contiguous() for k in names}, **heads}
    if dtype is not None:
        tensors = {k: v.to(dtype_from_name(dtype)) for k, v in tensors.items()}
    if dropped > 0:
        log.warning(
            "DSpark's confidence head has no input for the drafted token's embedding: its term"
            " (weight norm %.3g) is left out, so engines see an approximation of draftsmith's"
            " confidence",
            dropped,
        )
    return config, tensors, fields, dropped, str(tensors["fc.weight"].dtype).removeprefix("torch.")


def to_speculators_dspark(
    export_dir: str | Path,
    out_dir: str | Path,
    verifier_name_or_path: str,
    dtype: str | None = None,
    architectures: list[str] | None = None,
    source: str | Path | None = None,
    embed: torch.Tensor | None = None,
    lm_head: torch.Tensor | None = None,
) -> Path:
    """Write speculators' ``dspark`` folder of a DFlash export with heads into ``out_dir``
    (atomically); ``SpeculatorModel.from_pretrained(OUT)`` loads it as ``DSparkDraftModel``."""
    src = source or export_dir
    config, tensors, fields, dropped, written = _dspark_parts(
        export_dir, verifier_name_or_path, src, embed, lm_head, dtype
    )
    archs = architectures or verifier_architectures(
        verifier_name_or_path, str(config["target"].get("model_type"))
    )
    out = speculators_dflash_config(
        config, verifier_name_or_path, archs, written, Path(src).resolve()
    )
    out.update(fields, architectures=["DSparkSpeculator"], speculators_model_type="dspark")
    out["speculators_config"]["algorithm"] = "dspark"
    out["draftsmith"].update(confidence_dropped_term_norm=dropped)
    folder = atomic_folder_write(
        out_dir, lambda tmp: save_layout(tmp, tensors, out), sources=(export_dir, source)
    )
    log.info("wrote speculators dspark folder %s (verifier %s)", folder, verifier_name_or_path)
    return folder


def save_layout(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """``model.safetensors`` + ``config.json`` into the existing ``folder``."""
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_deepspec(export_dir: str | Path, out_dir: Path, target_dir: str | Path) -> dict[str, Any]:
    """Write the DeepSpec-style ``Qwen3DSparkModel`` folder llama.cpp's converter reads into the
    existing ``out_dir`` (module docstring); returns the export config with ``spec_method:
    dspark``."""
    config, tensors, fields, dropped, written = _dspark_parts(
        export_dir, str(target_dir), export_dir, None, None, None
    )
    arch = config["architecture"]
    out = zlab_config(config, written, Path(export_dir).resolve())
    out.update(
        fields,
        architectures=[DEEPSPEC_ARCHITECTURE],
        target_layer_ids=zlab_layer_ids(arch["target_layers"]),
        mask_token_id=int(arch["mask_token_id"]),
        sample_from_anchor=False,
    )
    out["draftsmith"].update(confidence_dropped_term_norm=dropped)
    save_layout(out_dir, tensors, out)
    return {**config, "spec_method": "dspark"}


__all__ = [
    "has_dspark_heads",
    "head_tensors",
    "local_lm_head",
    "to_speculators_dspark",
    "write_deepspec",
]
