"""LoRA adapter parts of an export (Medusa-2): naming, fingerprint, merging into the target's
weights.

The ``adapter`` part stores, for every adapted linear of the target at HF module path ``P`` (e.g.
``model.layers.0.self_attn.q_proj``), ``P.lora_A.weight`` [r, in] and ``P.lora_B.weight`` [out, r];
the export's ``inference.adapter`` block gives ``scaling`` (= alpha / r). Applying it is ``W_P +=
scaling * B @ A`` on the target's
``P.weight``: no peft needed to serve it. ``target.adapter.fingerprint`` in the export config is
:func:`adapter_fingerprint` of that part; a target identity carries the same block once the adapter
is applied.
"""

from __future__ import annotations

import hashlib

import torch

from draftsmith.export.format import ExportError

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
# Module paths hold dots, which nn.ModuleDict keys cannot: a trained adapter's state dict encodes
# them as "-".
PATH_SEP = "-"


def module_key_to_part_key(key: str) -> str:
    """``model-layers-0-self_attn-q_proj.lora_A.weight`` (a training module's key) -> the part's
    HF-path key."""
    path, _, rest = key.partition(".")
    return f"{path.replace(PATH_SEP, '.')}.{rest}"


def adapter_fingerprint(part: dict[str, torch.Tensor]) -> str:
    """sha256 over the part's names, shapes and fp32 values (independent of the dtype it is held
    in)."""
    digest = hashlib.sha256()
    for name in sorted(part):
        tensor = part[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def lora_pairs(part: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module path: (A [r, in], B [out, r])}``; ExportError for a part that is not a LoRA
    adapter."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in part:
        if name.endswith(LORA_A):
            path = name[: -len(LORA_A)]
            if path + LORA_B not in part:
                raise ExportError(
                    f"adapter part has {name} but no {path}{LORA_B}; re-export the drafter"
                )
            pairs[path] = (part[name], part[path + LORA_B])
        elif not name.endswith(LORA_B):
            raise ExportError(
                f"adapter part holds {name!r}, which is not a LoRA weight; re-export the drafter"
            )
    if not pairs:
        raise ExportError("adapter part holds no LoRA weights; re-export the drafter")
    return pairs


def merge_lora(
    weights: dict[str, torch.Tensor], part: dict[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """A copy of ``weights`` (HF names) with the adapter merged: ``W_P + scaling * B @ A`` for every
    adapted ``P``.

    The product is computed in fp32 and cast back to each weight's dtype.
    """
    merged = dict(weights)
    for path, (a, b) in lora_pairs(part).items():
        name = f"{path}.weight"
        if name not in weights:
            raise ExportError(
                f"the adapter changes {name}, which the target does not have: this export was "
                "trained for another model"
            )
        w = weights[name]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise ExportError(
                f"the adapter for {name} has shape {(b.shape[0], a.shape[1])}, the target's weight "
                f"{tuple(w.shape)}: this export was trained for another model"
            )
        delta = scaling * (b.float() @ a.float())  # [out, r] @ [r, in] -> [out, in]
        merged[name] = (w.float() + delta.to(w.device)).to(w.dtype)
    return merged
