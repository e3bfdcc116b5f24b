"""Convert a draftsmith DFlash export into vLLM's speculators ``dflash`` type (``--format
speculators``): the config.json of speculators 0.9.0's ``DFlashSpeculatorConfig`` and the drafter
body's tensors (export/dflash.py checks and names them; its docstring gives the tap conventions).

A DSpark-shaped drafter (a Markov or confidence head) is written as speculators' ``dspark`` type
instead (export/dspark.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from draftsmith.export.dflash import (
    _arch_int,
    conversion_provenance,
    converted_dflash,
    qwen3_layer_config,
)
from draftsmith.export.format import atomic_folder_write
from draftsmith.export.speculators import SPECULATORS_SCHEMA_VERSION
from draftsmith.export.verifier import verifier_architectures

log = logging.getLogger(__name__)


def speculators_aux_ids(taps: list[int]) -> list[int]:
    """speculators ``aux_hidden_state_layer_ids`` of draftsmith taps: unchanged (module
    docstring)."""
    return [int(t) for t in taps]


def speculators_dflash_config(
    config: dict[str, Any],
    verifier_name_or_path: str,
    architectures: list[str],
    dtype: str,
    source: str | Path = "",
    dropped: list[str] = (),
) -> dict[str, Any]:
    """The speculators ``dflash`` ``config.json`` (schema of speculators 0.9.0
    ``DFlashSpeculatorConfig``).

    ``speculative_tokens`` = ``block_size - 1``: the anchor slot holds the verified (bonus) token
    and the mask slots predict (``sample_from_anchor: false``, what vLLM's DFlash proposer runs).
    """
    arch = config["architecture"]
    block = int(arch["block_size"])
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_SCHEMA_VERSION,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": architectures},
        },
        "transformer_layer_config": {
            **qwen3_layer_config(config),
            "architectures": ["Qwen3ForCausalLM"],
        },
        "draft_vocab_size": _arch_int(arch, "vocab_size"),
        "block_size": block,
        "target_hidden_size": _arch_int(arch, "target_hidden_size", "hidden_size"),
        "aux_hidden_state_layer_ids": speculators_aux_ids(arch["target_layers"]),
        "mask_token_id": int(arch["mask_token_id"]),
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "torch_dtype": dtype,
        "draftsmith": conversion_provenance(config, source, list(dropped)),
    }


def to_speculators_dflash(
    export_dir: str | Path,
    out_dir: str | Path,
    verifier_name_or_path: str,
    dtype: str | None = None,
    architectures: list[str] | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write the speculators ``dflash`` folder of a DFlash export into ``out_dir`` (atomically):
    ``vllm serve OUT`` reads the verifier from its config. No embedding and no LM head are written
    (speculators' own DFlash checkpoints leave both out; vLLM and speculators take the
    verifier's)."""
    from draftsmith.export.dspark import has_dspark_heads, to_speculators_dspark

    if has_dspark_heads(
        export_dir
    ):  # DSpark-shaped: speculators' dspark type keeps the heads (export/dspark.py)
        return to_speculators_dspark(
            export_dir, out_dir, verifier_name_or_path, dtype, architectures, source
        )
    config, tensors, dropped, written = converted_dflash(export_dir, source, dtype, None)
    archs = architectures or verifier_architectures(
        verifier_name_or_path, str(config["target"].get("model_type"))
    )
    out_config = speculators_dflash_config(
        config, verifier_name_or_path, archs, written, Path(source or export_dir).resolve(), dropped
    )

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")

    out = atomic_folder_write(out_dir, fill, sources=(export_dir, source))
    log.info("wrote speculators dflash folder %s (verifier %s)", out, verifier_name_or_path)
    return out
