"""Proposer options that cannot run (`--proposer-option` on a Medusa and an EAGLE export): each
gets one actionable line naming the option and its allowed range, exit 2, never a traceback."""

from __future__ import annotations

import pytest
import torch
from recipe_configs import recipe_config
from test_cli_bad_inputs import FAST, run
from transformers import AutoModelForCausalLM

from draftsmith.distill.target.frozen import Target

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def eagle_export(tiny_target_dir, tiny_tokenizer, tmp_path_factory):
    """An EAGLE export of random weights for the tiny target."""
    from draftsmith.export.format import write_export
    from draftsmith.recipes.eagle import objective as eagle_recipe

    target = Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )
    torch.manual_seed(0)
    objective = eagle_recipe.build(recipe_config("eagle"), target)
    config = {**objective.export_config(), "target": target.identity(), "training": {}}
    return write_export(
        tmp_path_factory.mktemp("eagle") / "export", objective.module.state_dict(), config
    )


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "top_k=0",
            (
                "--proposer-option top_k=0 is out of range: an integer in 1..120 (the heads'"
                " vocabulary)"
            ),
        ),
        (
            "top_k=500",
            (
                "--proposer-option top_k=500 is out of range: an integer in 1..120 (the heads'"
                " vocabulary)"
            ),
        ),
        ("tree=[]", "--proposer-option tree=[] has no nodes: give a list of at least one path"),
        (
            "tree=[[5]]",
            "--proposer-option tree: path [5] must be non-empty with entries in [0, top_k=4)",
        ),
        (
            "tree=[[0],[0,0],[0,0,0]]",
            "--proposer-option tree is 3 deep, but the export has 2 heads (one per depth)",
        ),
    ],
)
def test_medusa_proposer_options_that_cannot_run(
    capsys, medusa_export, tiny_target_dir, option, message
):
    line = run(
        capsys,
        [
            "generate",
            "--drafter",
            str(medusa_export),
            "--target",
            str(tiny_target_dir),
            "--prompt",
            "hi",
            "--proposer-option",
            option,
            *FAST,
        ],
    )
    assert message in line


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "total_tokens=0",
            "--proposer-option total_tokens=0 is out of range: an integer >= 2 (tree nodes",
        ),
        ("depth=-1", "--proposer-option depth=-1 is out of range: an integer >= 0"),
        (
            "top_k=500",
            "--proposer-option top_k=500 is out of range: an integer in 1..120 (draft vocabulary)",
        ),
        ("top_k=0", "--proposer-option top_k=0 is out of range: an integer in 1..120"),
    ],
)
def test_eagle_proposer_options_that_cannot_run(
    capsys, eagle_export, tiny_target_dir, option, message
):
    line = run(
        capsys,
        [
            "generate",
            "--drafter",
            str(eagle_export),
            "--target",
            str(tiny_target_dir),
            "--prompt",
            "hi",
            "--proposer-option",
            option,
            *FAST,
        ],
    )
    assert message in line
