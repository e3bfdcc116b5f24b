"""The weights half of importing a speculators eagle3 checkpoint (export/speculators_import.py):
its tensors renamed to draftsmith's EAGLE-3 names, its embedding compared with the target's, its
``d2t``/``t2d`` vocabulary maps checked against each other, and every shape checked against the
architecture its config.json gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.export.format import ExportError, TargetMismatchError
from draftsmith.export.speculators import _LAYER_PARTS

# Trainer-only copies of the verifier's norm and LM head, and the verifier's embedding: not stored.
_SKIPPED = ("verifier_norm.weight", "verifier_lm_head.weight", "embed_tokens.weight")


def draftsmith_tensors(
    state: dict[str, torch.Tensor],
    arch: dict[str, Any],
    source: str | Path,
    embed_weight: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """speculators eagle3 tensors -> draftsmith EAGLE-3 state dict (module docstring); the
    checkpoint's embedding, when it has one, must be ``embed_weight`` (the target's) in the
    checkpoint's dtype."""
    names = {
        "fc.weight": "fc.weight",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        **{f"layers.0.{p}": f"layer.{p}" for p in _LAYER_PARTS},
    }
    missing = [k for k in names if k not in state]
    unknown = [k for k in state if k not in names and k not in ("d2t", "t2d", *_SKIPPED)]
    if missing or unknown:
        raise ExportError(
            f"{source}: weights do not match speculators' eagle3 layout for draftsmith's layer "
            f"(missing {missing[:4]}, unexpected {unknown[:4]})"
        )
    embed = state.get("embed_tokens.weight")
    if (
        embed is not None
        and embed_weight is not None
        and not torch.equal(embed, embed_weight.to(embed.dtype))
    ):
        raise TargetMismatchError(
            f"{source}: its embed_tokens.weight is not the target's embedding: the checkpoint "
            "was trained for another verifier; pass the target it was trained for with --target"
        )
    out = {new: state[old].float().contiguous() for old, new in names.items()}
    out.update(vocab_maps(state, arch, source))
    check_shapes(out, arch, source)
    return out


def expected_shapes(arch: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """draftsmith EAGLE-3 tensor -> (shape the architecture implies, the config keys that size
    it)."""
    h, i, v, n = (
        arch["hidden_size"],
        arch["intermediate_size"],
        arch["vocab_size"],
        arch["draft_vocab_size"],
    )
    q, kv = (
        arch["num_attention_heads"] * arch["head_dim"],
        arch["num_key_value_heads"] * arch["head_dim"],
    )
    heads, kv_heads = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
    shapes = {
        "fc.weight": (
            (h, len(arch["target_layers"]) * h),
            "hidden_size, eagle_aux_hidden_state_layer_ids",
        ),
        "norm.weight": ((h,), "hidden_size"),
        "lm_head.weight": ((n, h), "draft_vocab_size, hidden_size"),
        "layer.self_attn.q_proj.weight": ((q, 2 * h), heads),
        "layer.self_attn.k_proj.weight": ((kv, 2 * h), kv_heads),
        "layer.self_attn.v_proj.weight": ((kv, 2 * h), kv_heads),
        "layer.self_attn.o_proj.weight": ((h, q), heads),
        "layer.mlp.gate_proj.weight": ((i, h), "intermediate_size"),
        "layer.mlp.up_proj.weight": ((i, h), "intermediate_size"),
        "layer.mlp.down_proj.weight": ((h, i), "intermediate_size"),
        "d2t": ((n,), "draft_vocab_size"),
        "t2d": ((v,), "vocab_size"),
    }
    shapes.update(
        {
            f"layer.{p}": ((h,), "hidden_size")
            for p in (
                "input_layernorm.weight",
                "hidden_norm.weight",
                "post_attention_layernorm.weight",
            )
        }
    )
    return shapes


def check_shapes(
    tensors: dict[str, torch.Tensor], arch: dict[str, Any], source: str | Path
) -> None:
    """Refuse a checkpoint whose config.json and weights disagree (ExportError naming the config
    keys, the tensor and both shapes): imported as is, its export would record an identity its
    weights do not have.
    """
    for name, (shape, keys) in expected_shapes(arch).items():
        found = tuple(tensors[name].shape) if name in tensors else None
        if found is not None and found != shape:
            raise ExportError(
                f"{source}: config.json and model.safetensors disagree: {keys} give {name} the"
                f" shape {list(shape)}, the weights hold {list(found)}; import the config.json"
                " saved with these weights (a checkpoint folder of the speculators trainer is"
                " imported as saved)"
            )


def vocab_maps(
    state: dict[str, torch.Tensor], arch: dict[str, Any], source: str | Path
) -> dict[str, torch.Tensor]:
    """``d2t`` [N] int64 and ``t2d`` [V] bool, checked against each other (or the identity maps of a
    full vocab)."""
    n, v = arch["draft_vocab_size"], arch["vocab_size"]
    if "d2t" not in state and "t2d" not in state:
        if n != v:
            raise ExportError(
                f"{source}: draft_vocab_size {n} < vocab_size {v} but the checkpoint has no d2t/t2d"
                " maps"
            )
        return {"d2t": torch.zeros(n, dtype=torch.long), "t2d": torch.ones(v, dtype=torch.bool)}
    if "d2t" not in state or "t2d" not in state:
        raise ExportError(f"{source}: the checkpoint has only one of d2t/t2d; both or neither")
    d2t, t2d = state["d2t"].long(), state["t2d"].bool()
    if d2t.shape != (n,) or t2d.shape != (v,):
        raise ExportError(
            f"{source}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit draft_vocab_size"
            f" {n} and vocab_size {v}"
        )
    ids = torch.arange(n) + d2t  # the target id of every draft id
    if not torch.equal(torch.nonzero(t2d).flatten(), ids):
        raise ExportError(
            f"{source}: d2t and t2d disagree (i + d2t[i] must list t2d's True entries in order)"
        )
    return {"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}
