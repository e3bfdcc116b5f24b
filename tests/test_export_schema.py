"""An export's config.json is checked by a schema when it is read (export/schema.py): a wrong type,
an unknown method, verifier or stop policy, a weight part named outside the folder is one line
naming the key; NaN/inf weights and a config that disagrees with its weights are refused at load
(issue 50)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.cli import main
from draftsmith.export.format import (
    ExportError,
    ExportSchemaError,
    read_config,
    read_export,
    read_export_parts,
)
from draftsmith.export.schema import VERIFIER_NAMES
from draftsmith.heads.medusa import MedusaHeads

pytestmark = pytest.mark.unit


def edited(src: Path, dst: Path, changes: dict) -> Path:
    """A copy of the export ``src`` whose config.json got ``changes`` (dotted keys; None
    deletes)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        tree = config
        for key in parents:
            tree = tree.setdefault(key, {})
        if value is None:
            tree.pop(last)
        else:
            tree[last] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "changes,names",
    [
        ({"architecture": []}, "architecture must be an object, got [] (a list)"),
        ({"format_version": "abc"}, "format_version must be an integer, got 'abc'"),
        ({"method": "banana"}, "method 'banana' is not a method draftsmith has"),
        ({"method": 3}, "method must be a string"),
        ({"target": "x"}, "target must be an object"),
        ({"target.vocab_size": "many"}, "target.vocab_size must be an integer"),
        ({"inference": [1, 2]}, "inference must be an object"),
        (
            {"inference.verifier": "banana"},
            "inference.verifier 'banana' is not a verifier the runtime has",
        ),
        (
            {"inference.stop_policy": {"kind": "banana"}},
            "inference.stop_policy.kind 'banana' is not a stop policy",
        ),
        ({"inference.tree": "not a tree"}, "inference.tree must be a list of paths"),
        ({"parts": ["model"]}, "parts must be an object"),
        (
            {"parts.model.file": "../../chat.jsonl"},
            "parts.model.file '../../chat.jsonl' is outside what the export",
        ),
        (
            {"parts": {"../x": {"file": "model.safetensors"}}},
            "weight part '../x' is not a part name",
        ),
    ],
)
def test_a_config_that_breaks_the_schema_names_the_key(tmp_path, medusa_export, changes, names):
    export = edited(medusa_export, tmp_path / "m", changes)
    with pytest.raises(ExportSchemaError) as refused:
        read_config(export)
    assert names in str(refused.value) and str(export / "config.json") in str(refused.value)


def test_a_part_file_outside_the_folder_is_never_opened(tmp_path, medusa_export):
    """A part name used to be opened wherever it pointed, and the message said "missing,
    re-export"."""
    outside = tmp_path / "secret.safetensors"
    save_file({"w": torch.zeros(2)}, str(outside))
    export = edited(
        medusa_export,
        tmp_path / "m",
        {
            "parts": {
                "model": {"file": "model.safetensors"},
                "../secret": {"file": "../secret.safetensors"},
            }
        },
    )
    with pytest.raises(ExportSchemaError, match="weight part '../secret' is not a part name"):
        read_export_parts(export)


def test_wrong_architecture_types_are_named_not_python_internals(
    capsys, tmp_path, medusa_export, tiny_target_dir
):
    """ "invalid literal for int()" and "'list' object has no attribute 'get'" used to be the
    message."""
    export = edited(medusa_export, tmp_path / "m", {"architecture.num_heads": "two"})
    with pytest.raises(
        ExportSchemaError, match=r"architecture\.num_heads must be an integer, got 'two'"
    ):
        MedusaHeads.from_export(export, lm_head_weight=torch.zeros(120, 64))
    code = main(
        [
            "generate",
            "--drafter",
            str(export),
            "--target",
            str(tiny_target_dir),
            "--prompt",
            "hi",
            "--max-new-tokens",
            "2",
            "--dtype",
            "fp32",
        ]
    )
    err = capsys.readouterr().err
    assert (
        code == 2 and "architecture.num_heads must be an integer" in err and "Traceback" not in err
    )


def test_nan_weights_are_refused_at_load(tmp_path, medusa_export):
    """An export whose weights were all NaN was served without a word."""
    export = shutil.copytree(medusa_export, tmp_path / "m")
    tensors = load_file(str(export / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("inf")
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=f"{name} holds 1 NaN/inf values"):
        read_export(export)


def test_a_config_edited_against_its_weights_is_named(tmp_path, medusa_export):
    """A shape the architecture implies but the weights do not have: named, not torch's
    size-mismatch text."""
    from draftsmith.export.exportable import ExportContents, load_exported_state

    config, state = read_export(medusa_export)
    heads, _ = MedusaHeads.from_export(medusa_export, lm_head_weight=torch.zeros(120, 64))
    first = sorted(state)[0]
    state = {**state, first: torch.zeros(3, 3)}
    with pytest.raises(
        ExportError, match=f"gives {first} the shape .* the weights hold \\[3, 3\\]"
    ):
        load_exported_state(heads, ExportContents(Path(medusa_export), config, state))


def test_the_schema_knows_the_runtime_verifiers():
    from draftsmith.runtime.acceptance.choice import VERIFIERS

    assert sorted(VERIFIER_NAMES) == sorted(VERIFIERS)


def test_a_valid_export_reads_as_before(medusa_export):
    config = read_config(medusa_export)
    assert config["method"] == "medusa" and config["parts"]["model"]["file"] == "model.safetensors"
