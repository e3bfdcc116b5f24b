"""Convert a draftsmith EAGLE-3 export into the vLLM ``speculators`` format (schema of speculators
0.9.0).

The output folder holds a self-describing ``config.json`` and ``model.safetensors``; ``vllm serve
OUT`` reads the verifier from the config, and ``speculators.SpeculatorModel.from_pretrained(OUT)``
loads it (checked in tests/test_speculators_export.py against the real library).

DFlash exports go to speculators' ``dflash`` type: ``to_speculators`` hands them to
``export/speculators_dflash.py``.

EAGLE-1 is NOT converted: speculators 0.9.0 registers the model types dflash, dflash2, dspark,
eagle3, mtp, peagle and xpress only; its EAGLE-1/HASS support is a converter into ``eagle3`` for
checkpoints that already have EAGLE-3's shape. EAGLE-1's layer differs in ways eagle3's config
cannot express (fc over concat(embedding, feature) with a bias, q/k/v over h inputs with no input
norms, no final norm, the target's own LM head), so ``to_speculators`` refuses ``eagle`` exports
with an explanation.

config.json, field by field (draftsmith export field -> speculators field):

* ``speculators_model_type``: ``"eagle3"``; ``architectures``: ``["Eagle3Speculator"]`` (the library
  default); ``speculators_version``: ``"0.9.0"`` (the schema written here).
* ``speculators_config.algorithm``: ``"eagle3"``; ``proposal_methods``: one greedy chain proposal
  ``{proposal_type: greedy, speculative_tokens, verifier_accept_k: 1, accept_tolerance: 0.0}`` with
  ``speculative_tokens`` = the ``speculative_tokens`` argument, else ``inference.depth + 1`` (depth
  defaulting to 4 as in the runtime); ``default_proposal_method``: ``"greedy"``. speculators 0.9.0
  defines ``speculative_tokens`` as the number of tokens the speculator drafts per verifier forward
  (the most that can be accepted; vLLM's ``num_speculative_tokens``). draftsmith's EAGLE runtime
  follows EAGLE-2's ``depth``: its root step drafts depth 1 and ``depth`` more drafter forwards
  follow, so its longest drafted path (chain or dynamic tree) has ``depth + 1`` tokens. Writing
  ``depth + 1`` makes vLLM draft as far per step as ``draftsmith bench`` does with the export.
* ``speculators_config.verifier``: ``name_or_path`` = the ``verifier_name_or_path`` argument,
  written as given: pass something an engine can load, a hub id or a folder, never a draftsmith
  alias such as ``smollm2-135m`` (``draftsmith export --format speculators`` resolves aliases and
  defaults to the export's recorded target, writing a local folder as its absolute path). The
  embedded target is a dequantised GGUF, not the hub's SmolLM2 weights, so no hub id would name the
  model the drafter was trained on: on another machine, copy the verifier folder along and rerun the
  conversion with ``--target NEW_PATH`` (or edit ``name_or_path``). ``architectures`` = that
  folder's ``config.json`` ``architectures`` when it is a local folder, else derived from
  ``target.model_type``.
* ``transformer_layer_config``: a Llama config of the draft layer (speculators builds eagle3's first
  layer from it): ``model_type: llama``, ``num_hidden_layers: 1``, ``vocab_size`` = target vocab
  size (length of ``t2d``), ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``max_position_embeddings`` from
  ``architecture``; ``rope_theta`` and ``rope_parameters: {rope_type: default, rope_theta}`` (older
  and newer transformers); ``hidden_act: silu``, ``attention_bias: false``, ``mlp_bias: false``,
  ``tie_word_embeddings: false``.
* ``draft_vocab_size`` <- ``architecture.draft_vocab_size``; ``target_hidden_size`` <-
  ``hidden_size``; ``eagle_aux_hidden_state_layer_ids`` <- ``architecture.target_layers`` (both are
  HF ``hidden_states`` indices = the input of decoder layer i); ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output``: false (draftsmith's layer is plain EAGLE-3:
  residual = un-normed hidden, no fc norms, the pre-norm output is fed back across steps);
  ``embed_requires_grad``: false.
* ``torch_dtype`` / ``dtype``: the dtype the weights are written in.

model.safetensors keys (draftsmith -> speculators): ``fc.weight`` -> ``fc.weight``; ``layer.X`` ->
``layers.0.X`` for ``input_layernorm``, ``hidden_norm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``; ``norm.weight``, ``lm_head.weight`` as
is; ``d2t`` (int64) and ``t2d`` (bool) as is, omitted when the draft vocabulary is the full
vocabulary (speculators then has no maps). ``embed_tokens.weight`` (the frozen target embedding,
which draftsmith exports do not store) is copied from the verifier when ``verifier_name_or_path`` is
a local folder, or from ``embed_weight``: vLLM would share the verifier's embedding anyway, but
speculators 0.9.0 under transformers 5 leaves a missing embedding uninitialised (``torch.empty``)
instead of NaN, so its NaN check never loads it from the verifier.
Positions: speculators numbers pair ``t`` as position ``t+1``, draftsmith as ``t``; RoPE only
sees differences, so attention is identical.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.common.dtypes import dtype_from_name
from draftsmith.export.converters import ConvertRequest, ExportFormat, register_format
from draftsmith.export.format import ExportError, atomic_folder_write, read_export, tensor_bytes
from draftsmith.export.verifier import local_embedding, verifier_architectures

log = logging.getLogger(__name__)

SPECULATORS_SCHEMA_VERSION = "0.9.0"
_DTYPES = (
    "float32",
    "bfloat16",
    "float16",
)  # the torch spellings HF configs use (common.dtypes has all names)
_LAYER_PARTS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def speculators_tensors(
    state: dict[str, torch.Tensor], full_vocab: bool
) -> dict[str, torch.Tensor]:
    """Rename draftsmith EAGLE-3 weights to speculators' keys (see the module docstring)."""
    names = {
        "fc.weight": "fc.weight",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        **{f"layer.{p}": f"layers.0.{p}" for p in _LAYER_PARTS},
    }
    if not full_vocab:
        names.update({"d2t": "d2t", "t2d": "t2d"})
    missing = [k for k in names if k not in state]
    unexpected = [k for k in state if k not in names and k not in ("d2t", "t2d")]
    if missing or unexpected:
        raise ExportError(
            f"EAGLE-3 export weights do not match the expected layout (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}); re-export with this draftsmith version"
        )
    return {new: state[old].contiguous() for old, new in names.items()}


def speculators_config(
    config: dict[str, Any],
    verifier_name_or_path: str,
    speculative_tokens: int,
    architectures: list[str],
    dtype: str,
) -> dict[str, Any]:
    """The speculators ``config.json`` of a draftsmith EAGLE-3 export config."""
    arch = config["architecture"]
    theta = float(arch["rope_theta"])
    layer_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 1,
        "vocab_size": int(arch["vocab_size"]),
        "hidden_size": int(arch["hidden_size"]),
        "intermediate_size": int(arch["intermediate_size"]),
        "num_attention_heads": int(arch["num_attention_heads"]),
        "num_key_value_heads": int(arch["num_key_value_heads"]),
        "head_dim": int(arch["head_dim"]),
        "rms_norm_eps": float(arch["rms_norm_eps"]),
        "max_position_embeddings": int(arch["max_position_embeddings"]),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_SCHEMA_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": architectures},
        },
        "transformer_layer_config": layer_config,
        "draft_vocab_size": int(arch["draft_vocab_size"]),
        "target_hidden_size": int(arch["hidden_size"]),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in arch["target_layers"]],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": dtype,
    }


def refuse_other_methods(method: str, where: str | Path) -> None:
    """Refuse (one line) an export the speculators format has no type for: EAGLE-1 (no speculators
    type) and every method other than EAGLE-3 and DFlash."""
    if method == "eagle":
        raise ExportError(
            "speculators (0.9.0) has no model type for EAGLE-1 drafters (its types are eagle3, "
            "peagle, dflash, dflash2, dspark, mtp, xpress); train with recipe=eagle3 to serve "
            "through speculators/vLLM, or run the EAGLE-1 drafter in draftsmith's runtime"
        )
    if method not in ("eagle3", "dflash"):
        raise ExportError(
            f"the speculators format holds EAGLE-3 and DFlash drafters; {where} is a {method!r}"
            " export"
        )


def add_verifier_embedding(
    tensors: dict[str, torch.Tensor],
    arch: dict[str, Any],
    verifier_name_or_path: str,
    embed_weight: torch.Tensor | None,
) -> None:
    """Add ``embed_tokens.weight`` [V, H] to ``tensors``: ``embed_weight``, else the verifier's when
    it is a local folder (checked against the drafter's sizes); without either, warn."""
    embed = embed_weight if embed_weight is not None else local_embedding(verifier_name_or_path)
    if embed is None:
        log.warning(
            "no embedding written (verifier %s is not a local folder): vLLM shares the verifier's,"
            " but speculators' own loader may leave it uninitialised; pass embed_weight",
            verifier_name_or_path,
        )
        return
    if tuple(embed.shape) != (int(arch["vocab_size"]), int(arch["hidden_size"])):
        raise ExportError(
            f"verifier embedding has shape {tuple(embed.shape)}, expected"
            f" ({arch['vocab_size']}, {arch['hidden_size']}): is {verifier_name_or_path} the"
            " target this drafter was trained for?"
        )
    tensors["embed_tokens.weight"] = (
        embed.detach().to("cpu", tensors["fc.weight"].dtype).contiguous()
    )


def speculative_steps(config: dict[str, Any], speculative_tokens: int | None) -> int:
    """Tokens drafted per step: ``speculative_tokens``, default the export's ``inference.depth +
    1``."""
    # depth + 1: the runtime's longest drafted path (EAGLE-2's depth counts the forwards after the
    # root step); a missing depth defaults to 4 as in runtime/drafting/eagle.py's _proposer.
    depth = int((config.get("inference") or {}).get("depth", 4))
    steps = speculative_tokens if speculative_tokens is not None else depth + 1
    if steps < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {steps}")
    return steps


def to_speculators(
    export_dir: str | Path,
    out_dir: str | Path,
    verifier_name_or_path: str,
    speculative_tokens: int | None = None,
    dtype: str | None = None,
    architectures: list[str] | None = None,
    embed_weight: torch.Tensor | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write the speculators-format folder of a draftsmith EAGLE-3 export into ``out_dir``
    (atomically).

    ``verifier_name_or_path`` is what vLLM/speculators will load as the verifier (a hub id or a
    folder); ``speculative_tokens``: tokens drafted per step, default ``inference.depth + 1`` (see
    the module docstring); ``dtype`` (float32 | bfloat16 | float16) converts the floating weights,
    default: as exported; ``embed_weight`` (the target's input embedding) is written as
    ``embed_tokens.weight``; by default it is read from the verifier when that is a local folder;
    ``source``: what the user converted (a run folder exported into a temporary folder first), named
    in errors.
    """
    config, state = read_export(export_dir)
    method = config["method"]
    refuse_other_methods(method, source or export_dir)
    # speculators' dflash type has its own writer (export/speculators_dflash.py)
    if method == "dflash":
        from draftsmith.export.speculators_dflash import to_speculators_dflash

        return to_speculators_dflash(
            export_dir, out_dir, verifier_name_or_path, dtype, architectures, source
        )
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(_DTYPES)}")
    arch = config["architecture"]
    tensors = speculators_tensors(
        state, full_vocab=int(arch["draft_vocab_size"]) == int(arch["vocab_size"])
    )
    add_verifier_embedding(tensors, arch, verifier_name_or_path, embed_weight)
    if dtype is not None:
        tensors = {
            k: v.to(dtype_from_name(dtype)) if v.is_floating_point() else v
            for k, v in tensors.items()
        }
    written = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    steps = speculative_steps(config, speculative_tokens)
    archs = architectures or verifier_architectures(
        verifier_name_or_path, str(config["target"].get("model_type"))
    )
    out_config = speculators_config(config, verifier_name_or_path, steps, archs, written)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")

    out = atomic_folder_write(
        out_dir, fill, sources=(export_dir, source), size_hint=tensor_bytes(tensors)
    )
    log.info("wrote speculators eagle3 folder %s (verifier %s)", out, verifier_name_or_path)
    return out


def _convert_request(request: ConvertRequest) -> Path:
    """``--format speculators``: the verifier is ``--target`` or the recorded target, as an absolute
    folder."""
    return to_speculators(
        request.export_dir, request.out, request.verifier_folder(), source=request.source
    )


register_format(
    ExportFormat(
        "speculators",
        ("eagle3", "dflash"),
        _convert_request,
        help="vLLM's speculators format (vllm serve OUT)",
    )
)
