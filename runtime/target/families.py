"""What each model family's ``config.json`` switches on in the lean decoder: windows per layer,
RoPE, Gemma features.

Pure functions over the parsed HF config dict (no torch, no weights), read by
:meth:`draftsmith.runtime.target.model_config.ModelConfig.from_hf_dict`. Every default below is the
installed transformers' own for that family, so a config.json that omits a field means what it means
to transformers.
"""

from __future__ import annotations

from typing import Any, NoReturn

from draftsmith.common.errors import DraftsmithError

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3_text",
)  # SmolLM says "llama"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA_TYPES = ("gemma2", "gemma3_text")
SLIDING = "sliding_attention"


class UnsupportedArchitecture(DraftsmithError, NotImplementedError):
    """The checkpoint is not one the lean decoder implements; load it with the HF fallback
    (backend='hf'). ``feature`` names what is missing in a few words (e.g. "rope type 'yarn'")."""

    def __init__(self, message: str, feature: str | None = None) -> None:
        super().__init__(message)
        self.feature = feature or message


def refuse(feature: str, detail: str = "") -> NoReturn:
    """Raise UnsupportedArchitecture for ``feature`` with the fallback hint."""
    raise UnsupportedArchitecture(
        f"{feature} is not supported by the lean decoder{detail}; use the transformers "
        "fallback (backend='hf')",
        feature,
    )


def check_model_type(cfg: dict[str, Any]) -> str:
    """The config's model_type, refused unless the lean decoder implements that family."""
    model_type = cfg.get("model_type", "<missing>")
    if model_type not in SUPPORTED_MODEL_TYPES:
        refuse(f"model_type {model_type!r}", f" (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.get("use_bidirectional_attention"):
        refuse("bidirectional attention (use_bidirectional_attention)")
    return model_type


def activation(cfg: dict[str, Any], model_type: str) -> str:
    """The MLP's gate activation (Gemma reads ``hidden_activation`` first, like transformers)."""
    act = cfg.get("hidden_act") or "silu"
    if model_type in GEMMA_TYPES:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in SUPPORTED_ACTIVATIONS:
        refuse(f"hidden_act {act!r}", f" (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    return act


def _rope(params: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of one RoPE parameter dict; scaling is {} for the default type."""
    rope = dict(params)
    theta = float(rope.pop("rope_theta", None) or default_theta)
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        refuse(f"rope type {rope_type!r}", f" (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial rotary embeddings (partial_rotary_factor)")
    return theta, ({**rope, "rope_type": rope_type} if rope_type != "default" else {})


def rope_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` and, for Gemma-3, the local layers' ``local_rope_theta`` /
    ``local_rope_scaling``. transformers v5 writes ``rope_parameters`` (theta inside; Gemma-3 one
    dict per layer type), v4 wrote ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq`` for
    Gemma-3)."""
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial rotary embeddings (partial_rotary_factor)")
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    gemma3 = model_type == "gemma3_text"
    theta0 = float(cfg.get("rope_theta") or (1_000_000.0 if gemma3 else 10_000.0))
    local0 = float(cfg.get("rope_local_base_freq") or 10_000.0)
    if "full_attention" in params or SLIDING in params:  # per layer type (Gemma-3, transformers v5)
        theta, scaling = _rope(params.get("full_attention") or {}, theta0)
        local = _rope(params.get(SLIDING) or {}, local0)
    else:
        theta, scaling = _rope(params, theta0)
        local = (local0, {}) if gemma3 else None
    out: dict[str, Any] = {"rope_theta": theta, "rope_scaling": scaling}
    if local is not None:
        out["local_rope_theta"], out["local_rope_scaling"] = local
    return out


def layer_windows(
    cfg: dict[str, Any], model_type: str
) -> tuple[tuple[int | None, ...], int | None]:
    """(the sliding window of each layer or None for a global layer, the configured window).

    As transformers applies them: Mistral and Phi-3 window every layer; Qwen2/3 only with
    ``use_sliding_window``, on the layers ``layer_types`` marks (else those from
    ``max_window_layers`` on); Gemma-2 alternates local and global (layer_types, else every second
    layer global), Gemma-3 has one global layer per ``sliding_window_pattern`` (default 6). A window
    at least ``max_position_embeddings`` long never masks a position the model can reach: those
    layers count as global (the cache is then refused beyond the window).
    """
    n = int(cfg["num_hidden_layers"])
    window = cfg.get(
        "sliding_window", 4096 if model_type in ("mistral", *GEMMA_TYPES) else None
    )  # class defaults
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window size that is inactive unless use_sliding_window
    if model_type == "llama" or not window:
        return (None,) * n, None
    window = int(window)
    types = cfg.get("layer_types")
    if model_type in ("mistral", "phi3"):
        local = [True] * n  # transformers ignores layer_types for these
    elif types:
        if len(types) != n:
            refuse(f"layer_types of length {len(types)} for {n} layers")
        local = [t == SLIDING for t in types]
    elif model_type in ("qwen2", "qwen3"):
        local = [i >= int(cfg.get("max_window_layers", 28)) for i in range(n)]
    else:
        period = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        local = [bool((i + 1) % period) for i in range(n)]
    if window >= int(cfg.get("max_position_embeddings", 2048)):
        return (None,) * n, window
    return tuple(window if is_local else None for is_local in local), window


def gemma_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Gemma-2/3: (1 + w) RMSNorms, sandwich norms, embeddings times sqrt(hidden),
    query_pre_attn_scalar, softcaps (Gemma-2 defaults 50 / 30, Gemma-3 none). {} for other
    families."""
    if model_type not in GEMMA_TYPES:
        return {}
    gemma2 = model_type == "gemma2"
    attn_cap = cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None)
    final_cap = cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)
    return {
        "norm_plus_one": True,
        "sandwich_norms": True,
        "embed_scale": float(cfg["hidden_size"]) ** 0.5,
        "attn_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_softcap": float(attn_cap) if attn_cap else None,
        "final_softcap": float(final_cap) if final_cap else None,
    }
