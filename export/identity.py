"""Identity of a target model, recorded in every export so a drafter is never run against another
target.

``fingerprint`` needs the tokenizer; ``lm_head`` (the LM head alone) and the sizes do not, so a
runtime that holds only the decoder (a proposer builder) can still tell another target apart:
:func:`decoder_identity`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 over the tokenizer's vocabulary (token -> id, sorted) and its special tokens."""
    vocab = tokenizer.get_vocab()
    payload = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    special = json.dumps(sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", [])))
    return hashlib.sha256((payload + special).encode("utf-8")).hexdigest()


def lm_head_digest(weight: torch.Tensor) -> str:
    """sha256 of the LM head rounded to bfloat16, so fp32 and bf16 loads of one model agree."""
    w = weight.detach().to("cpu", torch.float32).to(torch.bfloat16).contiguous()
    return hashlib.sha256(w.view(torch.int16).numpy().tobytes()).hexdigest()


def target_identity(
    name_or_path: str, hf_config: Any, tokenizer: Any, lm_head_weight: torch.Tensor
) -> dict:
    """The ``target`` block of an export's config.json.

    ``fingerprint`` hashes the tokenizer vocabulary and the LM head; ``lm_head`` the LM head alone
    (checkable without the tokenizer); sizes are kept in clear so a mismatch can be explained field
    by field.
    """
    head = lm_head_digest(lm_head_weight)
    digest = hashlib.sha256((tokenizer_digest(tokenizer) + head).encode()).hexdigest()
    return {
        "name_or_path": str(name_or_path),
        "model_type": str(getattr(hf_config, "model_type", "unknown")),
        "vocab_size": int(lm_head_weight.shape[0]),
        "hidden_size": int(hf_config.hidden_size),
        "num_hidden_layers": int(hf_config.num_hidden_layers),
        "fingerprint": "sha256:" + digest,
        "lm_head": "sha256:" + head,
    }


def decoder_identity(
    name_or_path: str,
    hidden_size: int | None,
    num_hidden_layers: int | None,
    lm_head_weight: torch.Tensor | None,
    digest: bool = True,
) -> dict:
    """The identity fields computable from a loaded decoder alone (no tokenizer, hence no
    ``fingerprint``).

    Fields that cannot be known (None arguments) are left out; ``check_target`` only compares fields
    present. ``digest=False`` skips hashing the LM head (about a second for a 50k x 576 head on a
    small CPU).
    """
    identity: dict[str, Any] = {"name_or_path": str(name_or_path)}
    if lm_head_weight is not None:
        identity["vocab_size"] = int(lm_head_weight.shape[0])
        if digest:
            identity["lm_head"] = "sha256:" + lm_head_digest(lm_head_weight)
    if hidden_size is not None:
        identity["hidden_size"] = int(hidden_size)
    if num_hidden_layers is not None:
        identity["num_hidden_layers"] = int(num_hidden_layers)
    return identity


def export_digest(
    method: str, architecture: dict[str, Any], shapes: dict[str, dict[str, list[int]]]
) -> str:
    """sha256 over what makes an export one module: its ``method``, the keys of its ``architecture``
    block and every weight part's tensor names and shapes (``shapes``: part name -> tensor name ->
    shape). Editing ``method`` (even to a method with the same weights layout), adding or dropping
    an architecture key, or changing a tensor's name or shape changes it. Architecture values,
    dtypes and weight values do not count: values are the converters' and loaders' to check (e.g. a
    tap index an engine cannot capture), and a tuned export may change them.
    """
    payload = {
        "method": str(method),
        "architecture_keys": sorted(str(k) for k in architecture),
        "weights": {
            part: sorted([name, [int(d) for d in shape]] for name, shape in names.items())
            for part, names in sorted(shapes.items())
        },
    }
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
