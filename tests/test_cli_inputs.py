"""What a command says about the inputs it is given (issue 50): a model folder's own code never runs
without ``--trust-remote-code`` (one line instead of transformers' stdin prompt); a folder is named
as what it is (an export passed as --target, a speculators or converted layout passed as --drafter,
a model folder passed to import); prompt specs that name nothing are refused as such, before any
model work."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.cli import main
from draftsmith.common.errors import RemoteCodeRefused
from draftsmith.common.remote_code import refuse_remote_code, remote_code_files

pytestmark = pytest.mark.unit

CODE = (
    "import os, pathlib\npathlib.Path(os.environ['MARK']).write_text('ran')\nfrom transformers"
    " import LlamaConfig\n\nclass SweepConfig(LlamaConfig):\n    model_type = 'sweep_llama'\n"
)


@pytest.fixture()
def remote_target(tmp_path, tiny_target_dir, monkeypatch) -> Path:
    """The tiny target relabelled as a model whose code ships in its folder; running that code
    writes MARK."""
    folder = shutil.copytree(tiny_target_dir, tmp_path / "remote")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="sweep_llama",
        auto_map={
            "AutoConfig": "configuration_sweep.SweepConfig",
            "AutoModelForCausalLM": "configuration_sweep.SweepConfig",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_sweep.py").write_text(CODE)
    monkeypatch.setenv("MARK", str(tmp_path / "ran"))
    monkeypatch.setattr(
        sys, "stdin", io.StringIO("y\n")
    )  # transformers' prompt would take this as a yes
    return folder


def one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--max-new-tokens", "2"],
        ["bench", "--oracle-acceptance", "0.8", "--max-new-tokens", "2", "--num-prompts", "1"],
        ["regenerate", "--out", "{tmp}/o.jsonl", "--limit", "1", "--data", "{data}"],
        ["rollouts", "--out", "{tmp}/r", "--limit", "1", "--samples-per-prompt", "2"],
    ],
)
def test_a_folder_that_ships_code_is_refused_without_the_opt_in(
    capsys, tmp_path, remote_target, tiny_data_file, argv
):
    """`generate` and `bench` did not pass trust_remote_code: transformers asked on stdin and a `y`
    ran the code."""
    argv = [a.format(tmp=tmp_path, data=tiny_data_file) for a in argv] + [
        "--target",
        str(remote_target),
    ]
    line = one_line(capsys, argv)
    assert f"{remote_target} ships its own Python code" in line and "--trust-remote-code" in line
    assert not (tmp_path / "ran").exists()


def test_import_against_a_folder_that_ships_code_is_refused(
    capsys, tmp_path, remote_target, medusa_export
):
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    save_file({"fc.weight": torch.zeros(2, 2)}, str(spec / "model.safetensors"))
    line = one_line(
        capsys, ["import", str(spec), "--out", str(tmp_path / "i"), "--target", str(remote_target)]
    )
    assert "--trust-remote-code" in line and not (tmp_path / "ran").exists()


def test_which_folders_ship_code(tmp_path, tiny_target_dir, remote_target):
    assert remote_code_files(tiny_target_dir) == []
    assert remote_code_files(remote_target) == [
        "config.json auto_map ['AutoConfig', 'AutoModelForCausalLM']"
    ]
    known = shutil.copytree(
        tiny_target_dir, tmp_path / "known"
    )  # auto_map on a type transformers has: its code
    config = json.loads((known / "config.json").read_text())
    (known / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.Y"}}))
    assert remote_code_files(known) == []
    refuse_remote_code(remote_target, allowed=True)
    with pytest.raises(RemoteCodeRefused):
        refuse_remote_code(remote_target, allowed=False)


def test_every_command_that_loads_a_target_has_the_opt_in():
    from draftsmith.cli import build_parser

    parser = build_parser()
    for command in (
        "generate",
        "regenerate",
        "rollouts",
        "trajectories",
        "calibrate",
        "import",
        "engine-check",
        "export",
    ):
        sub = parser._subparsers._group_actions[0].choices[command]
        assert "--trust-remote-code" in sub._option_string_actions, command
    bench = parser._subparsers._group_actions[0].choices["bench"]
    for mode in ("export", "controller", "reward", "diffusion"):
        assert (
            "--trust-remote-code"
            in bench._subparsers._group_actions[0].choices[mode]._option_string_actions
        )


@pytest.fixture()
def layouts(tmp_path, medusa_export) -> dict[str, Path]:
    """A speculators folder and the Medusa export converted to the vLLM layout."""
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "config.json").write_text(
        json.dumps({"speculators_model_type": "eagle3", "speculators_config": {}})
    )
    assert (
        main(["export", str(medusa_export), "--out", str(tmp_path / "vllm"), "--format", "medusa"])
        == 0
    )
    return {"spec": spec, "vllm": tmp_path / "vllm"}


def test_a_folder_is_named_as_what_it_is(capsys, layouts, medusa_export, tiny_target_dir):
    """A speculators or vLLM-Medusa folder passed as --drafter was called "a target model folder";
    --target pointed at an export suggested installing sentencepiece."""
    base = ["generate", "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32"]
    line = one_line(
        capsys, [*base, "--target", str(tiny_target_dir), "--drafter", str(layouts["spec"])]
    )
    assert (
        "is a speculators 'eagle3' checkpoint" in line
        and f"draftsmith import {layouts['spec']}" in line
    )
    line = one_line(
        capsys, [*base, "--target", str(tiny_target_dir), "--drafter", str(layouts["vllm"])]
    )
    assert (
        "is a draftsmith export converted to the medusa layout" in line
        and str(medusa_export) in line
    )
    line = one_line(capsys, [*base, "--target", str(medusa_export)])
    assert (
        f"--target {medusa_export} is a draftsmith 'medusa' export (a drafter), not a target model"
        in line
    )
    assert "sentencepiece" not in line


def test_import_names_what_a_folder_is(capsys, tmp_path, medusa_export, tiny_target_dir):
    """`import` of a non-speculators folder said "a speculators None checkpoint"."""
    for folder, what in (
        (tiny_target_dir, "a target model folder (llama)"),
        (medusa_export, "a draftsmith 'medusa' export"),
    ):
        line = one_line(
            capsys,
            ["import", str(folder), "--out", str(tmp_path / "i"), "--target", str(tiny_target_dir)],
        )
        assert f"{folder} is {what}, not a speculators checkpoint" in line and "None" not in line


def test_engine_check_of_a_medusa_export_says_so(capsys, medusa_export):
    """It quoted a `--format gguf` the user never typed."""
    line = one_line(capsys, ["engine-check", str(medusa_export)])
    assert (
        "is a 'medusa' export; engine-check runs EAGLE-3, DFlash drafters" in line
        and "--format" not in line
    )


@pytest.mark.parametrize(
    "spec,says",
    [
        ("{empty}", "is a folder"),
        ("mtbench[a:b]", "a slice is NAME[START:STOP] with whole numbers"),
        ("mtbench[5:2]", "mtbench[5:2] selects no prompts"),
        ("nosuch[0:3]", "nosuch: no such file, and not a prompt set"),
        ("{tmp}/nosuch.jsonl", "no such file, and not a prompt set (mtbench, humaneval, sharegpt)"),
    ],
)
def test_prompt_specs_that_name_nothing(tmp_path, spec, says):
    """Slice errors and folders were all "prompts file ... not found"."""
    from draftsmith.common.errors import DraftsmithError
    from draftsmith.common.prompt_sets import prompt_texts

    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftsmithError, match=None) as refused:
        prompt_texts(spec.format(empty=tmp_path / "empty", tmp=tmp_path))
    assert says in str(refused.value)


@pytest.mark.parametrize("tokens", ["5000", str(10**9)])
def test_max_new_tokens_past_the_context_is_one_line(capsys, tiny_target_dir, tokens):
    """5,000 new tokens on a 512-position target were generated past it; 10**9 ended in an allocator
    error."""
    line = one_line(
        capsys,
        [
            "generate",
            "--target",
            str(tiny_target_dir),
            "--prompt",
            "hello world",
            "--dtype",
            "fp32",
            "--max-new-tokens",
            tokens,
        ],
    )
    assert f"--max-new-tokens {tokens} does not fit" in line and "context is 512 positions" in line


@pytest.mark.parametrize("opt_in", [False, True])
def test_generate_always_passes_trust_remote_code_to_transformers(
    capsys, tiny_target_dir, monkeypatch, opt_in
):
    """Left unset, transformers asks on stdin for a folder with code; draftsmith always says False
    (or the opt-in)."""
    import transformers

    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", "unset"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    argv = [
        "generate",
        "--target",
        str(tiny_target_dir),
        "--prompt",
        "hello",
        "--max-new-tokens",
        "2",
        "--dtype",
        "fp32",
        *(["--trust-remote-code"] if opt_in else []),
    ]
    assert main(argv) == 0
    assert seen and set(seen) == {opt_in}


def test_misleading_messages_of_the_sweep_name_the_real_problem(
    tmp_path, medusa_export, tiny_data_file
):
    """A folder given as --data was "does not exist"; a config.json holding a list was "a folder
    with no config.json"; a partial without its settings file was "written with other settings (None
    ...)".
    """
    from draftsmith.common.errors import DraftsmithError
    from draftsmith.datagen import regenerate as regen
    from draftsmith.export.format import read_config

    (tmp_path / "d").mkdir()
    with pytest.raises(DraftsmithError, match=f"--data {tmp_path / 'd'} is a folder"):
        regen.regenerate(str(tmp_path / "d"), tmp_path / "o.jsonl")
    export = shutil.copytree(medusa_export, tmp_path / "m")
    (export / "config.json").write_text("[1]")
    with pytest.raises(DraftsmithError, match="is a folder whose config.json is not a JSON object"):
        read_config(export)
    out = tmp_path / "p.jsonl"
    Path(f"{out}.partial").write_text('{"source_index": 0}\n')
    with pytest.raises(DraftsmithError, match="has no readable settings file"):
        regen.regenerate(str(tiny_data_file), out)
