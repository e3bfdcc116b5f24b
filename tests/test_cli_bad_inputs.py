"""Bad inputs to the serving and export commands: each gets one actionable line and exit 2, never a
traceback.

Corrupt target folders, an export whose method was edited, a file where an export folder goes,
counts below 1, and `export --format` of a run folder (its temporary export always removed).
Proposer options that cannot run: tests/test_cli_proposer_options.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.bench.prompts import load_prompts
from draftsmith.cli import main
from draftsmith.distill.engine.exporting import DRAFTER_PREFIX, export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--dtype", "fp32", "--max-new-tokens", "2"]


@pytest.fixture(scope="module")
def target(tiny_target_dir, tiny_tokenizer):
    return Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )


@pytest.fixture(scope="module")
def medusa(target):
    """(heads, objective) of two untrained Medusa heads on the tiny target."""
    torch.manual_seed(0)
    heads = MedusaHeads(
        MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=2),
        target.lm_head_weight.float(),
    )
    return heads, MedusaObjective(
        heads, 0.8, "dataset", 5, default_tree(2, 6, 4), {"top_k": 4, "verifier": "greedy"}
    )


@pytest.fixture(scope="module")
def medusa_export(medusa, target, tmp_path_factory):
    heads, objective = medusa

    class Live:
        drafter, run_info = heads, {"target": target.identity()}

    Live.objective = objective
    return export_from_module(Live, tmp_path_factory.mktemp("medusa") / "export", training={})


def run(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; assert exit 2 with one error line and no traceback; return that
    line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftsmith ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def damaged_copy(src: Path, dst: Path, name: str, damage) -> Path:
    shutil.copytree(src, dst)
    damage(dst / name)
    return dst


# ---- 1. a corrupt target folder ------------------------------------------------------------------


def test_a_corrupt_target_config_is_named_with_its_line(
    capsys, tmp_path, tiny_target_dir, medusa_export
):
    bad = damaged_copy(
        tiny_target_dir,
        tmp_path / "bad",
        "config.json",
        lambda f: f.write_text('{\n  "model_type": "llama",\n  "hidden_size": ,\n}'),
    )
    want = (
        f"{bad / 'config.json'} is not valid JSON (line 3: Expecting value): re-download or re-save"
        " the target"
    )
    line = run(capsys, ["generate", "--target", str(bad), "--prompt", "hi", *FAST])
    assert line.startswith("draftsmith generate: error: ") and want in line
    line = run(capsys, ["bench", "--drafter", str(medusa_export), "--target", str(bad), *FAST])
    assert line.startswith("draftsmith bench: error: ") and want in line


def test_a_truncated_target_weights_file_is_named(capsys, tmp_path, tiny_target_dir, medusa_export):
    def truncate(f: Path) -> None:
        f.write_bytes(f.read_bytes()[:4000])

    bad = damaged_copy(tiny_target_dir, tmp_path / "bad", "model.safetensors", truncate)
    want = f"{bad / 'model.safetensors'} is truncated or corrupt"
    for argv in (
        ["generate", "--prompt", "hi"],
        ["bench", "--drafter", str(medusa_export), "--skip-hf"],
    ):
        line = run(capsys, [*argv, "--target", str(bad), *FAST])
        assert want in line and "re-download or re-save the target" in line


def test_a_corrupt_generation_config_is_named(capsys, tmp_path, tiny_target_dir):
    bad = damaged_copy(
        tiny_target_dir, tmp_path / "bad", "generation_config.json", lambda f: f.write_text("{")
    )
    line = run(capsys, ["generate", "--target", str(bad), "--prompt", "hi", *FAST])
    assert f"{bad / 'generation_config.json'} is not valid JSON (line 1" in line


# ---- 2. an export whose method was edited --------------------------------------------------------


@pytest.mark.parametrize(
    ("claimed", "config_class"),
    [("eagle3", "Eagle3Config"), ("eagle", "EagleConfig"), ("hydra", "HydraConfig")],
)
def test_an_export_relabelled_to_another_method_is_one_line(
    capsys, tmp_path, tiny_target_dir, medusa_export, claimed, config_class
):
    relabelled = shutil.copytree(medusa_export, tmp_path / "relabelled")
    config = json.loads((relabelled / "config.json").read_text())
    (relabelled / "config.json").write_text(json.dumps({**config, "method": claimed}))
    line = run(
        capsys,
        [
            "generate",
            "--drafter",
            str(relabelled),
            "--target",
            str(tiny_target_dir),
            "--prompt",
            "hi",
            *FAST,
        ],
    )
    assert f"{relabelled} claims method {claimed!r}, but its architecture fields [" in line
    # the export's identity names the method to restore
    assert f"are unknown to {config_class}" in line
    assert 'it was written as a \'medusa\' export: restore "method": "medusa"' in line
    assert "unexpected keyword" not in line


# ---- 3. a file where an export folder goes -------------------------------------------------------


def test_a_file_given_as_an_export_folder_is_refused(capsys, medusa_export, tiny_target_dir):
    file = medusa_export / "config.json"
    for command, flag in (
        ("generate", "--controller"),
        ("generate", "--drafter"),
        ("bench", "--controller"),
        ("bench", "--drafter"),
    ):
        extra = ["--prompt", "hi"] if command == "generate" else []
        line = run(
            capsys, [command, flag, str(file), "--target", str(tiny_target_dir), *extra, *FAST]
        )
        assert (
            line
            == f"draftsmith {command}: error: {flag} {file} is a file, not an export folder: pass"
            " the "
            f"folder that holds config.json ({medusa_export})"
        )


def test_read_config_says_a_file_is_not_an_export_folder(medusa_export):
    from draftsmith.export.format import ExportError, read_config

    with pytest.raises(
        ExportError, match="is a file, not an export folder: pass the folder that holds config.json"
    ):
        read_config(medusa_export / "model.safetensors")


# ---- 4 and 5. counts below 1, refused before anything loads --------------------------------------


@pytest.mark.parametrize("value", ["0", "-3"])
def test_num_prompts_below_one_is_refused_before_loading(capsys, value):
    line = run(capsys, ["bench", "--drafter", "/nonexistent/export", "--num-prompts", value])
    assert (
        line
        == f"draftsmith bench export: error: --num-prompts must be >= 1, got {value} (leave it out"
        " to use every prompt) (see draftsmith bench export --help)"
    )


def test_load_prompts_refuses_a_limit_below_one(tiny_tokenizer):
    for limit in (0, -2):  # 0 used to mean every prompt, -N every prompt but N
        with pytest.raises(ValueError, match=f"number of prompts must be >= 1, got {limit}"):
            load_prompts("mtbench", tiny_tokenizer, limit)


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_max_new_tokens_below_one_is_refused_before_loading(capsys, command, value):
    extra = ["--prompt", "hi"] if command == "generate" else ["--drafter", "/nonexistent/export"]
    line = run(
        capsys, [command, *extra, "--target", "/nonexistent/target", "--max-new-tokens", value]
    )
    prog = "bench export" if command == "bench" else command  # the bench's default mode
    assert (
        line
        == f"draftsmith {prog}: error: --max-new-tokens must be >= 1, got {value} (see draftsmith"
        f" {prog} --help)"
    )


# ---- 6. export --format of a run folder ----------------------------------------------------------


@pytest.fixture
def run_folder(tmp_path, medusa, target):
    """A run folder whose checkpoints/last.ckpt holds the Medusa heads, as training leaves it."""
    heads, objective = medusa
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(
        {
            "state_dict": {DRAFTER_PREFIX + k: v for k, v in heads.state_dict().items()},
            "global_step": 3,
            "draftsmith": {"export_config": objective.export_config(), "target": target.identity()},
        },
        run_dir / "checkpoints" / "last.ckpt",
    )
    return run_dir


def test_export_of_a_run_folder_to_a_format_it_refuses_leaves_nothing(capsys, run_folder, tmp_path):
    line = run(
        capsys,
        ["export", str(run_folder), "--out", str(tmp_path / "spec"), "--format", "speculators"],
    )
    assert (
        line
        == f"draftsmith export: error: {run_folder}: --format speculators does not hold 'medusa'"
        " exports; Medusa-1 exports as: draftsmith, medusa, medusa-tgi"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run"
    ]  # no <out>.draftsmith, no temporary folder


def test_export_of_a_run_folder_to_a_layout_keeps_only_the_layout(capsys, run_folder, tmp_path):
    assert (
        main(["export", str(run_folder), "--out", str(tmp_path / "vllm"), "--format", "medusa"])
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "vllm"]
    converted = json.loads((tmp_path / "vllm" / "config.json").read_text())["draftsmith"][
        "converted_from"
    ]
    assert converted == str(run_folder.resolve())  # the user's source, not a temporary folder


def test_export_of_an_export_folder_says_what_to_do(capsys, medusa_export, tmp_path):
    line = run(capsys, ["export", str(medusa_export), "--out", str(tmp_path / "again")])
    assert (
        f"{medusa_export} is already a draftsmith export" in line
        and "--format medusa|speculators" in line
    )
