"""Learn2PD end to end on tiny models: oracle trajectories on disk, the trajectory batch kind, the
filter recipe, its export and the bad inputs (broken folders, another block length, a causal target,
an over-long prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama
from recipe_configs import recipe_config

from draftsmith.common.errors import ConfigError, DataError
from draftsmith.controllers.learn2pd import FilterMismatchError, Learn2PDConfig, Learn2PDFilter
from draftsmith.datagen.trajectories import TrajectoryError, write_trajectories
from draftsmith.distill.data.trajectories import TrajectoryDataModule, read_trajectories
from draftsmith.export.format import write_export
from draftsmith.runtime.decoding.diffusion import DiffusionDecodeConfig
from draftsmith.runtime.target.diffusion_lm import DiffusionLM, DiffusionSpec

pytestmark = pytest.mark.unit

CFG = DiffusionDecodeConfig(gen_length=16, steps_per_block=8)


@pytest.fixture(scope="module")
def lm() -> DiffusionLM:
    return DiffusionLM(
        build_tiny_llama(64, seed=4), None, DiffusionSpec(block_length=8, mask_token_id=63), "tiny"
    )


@pytest.fixture(scope="module")
def traj_dir(lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("traj") / "t"
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    first = write_trajectories(lm, prompts, out, CFG, shard_size=2)
    again = write_trajectories(lm, prompts, out, CFG, shard_size=2)  # resumes: nothing new
    assert first["examples"] == again["examples"] > 0 and again["new_examples"] == 0
    assert again["resumed_prompts"] == 3
    return out


def test_trajectory_folder_reads_back(traj_dir):
    meta, conf, labels = read_trajectories(traj_dir)
    assert meta["block_length"] == 8 and conf.shape == labels.shape and conf.shape[1] == 8
    assert torch.all((conf > 0) & (conf <= 1)) and set(labels.unique().tolist()) <= {0.0, 1.0}


def test_broken_trajectory_folders_are_refused(traj_dir, tmp_path):
    with pytest.raises(DataError, match="empty or not a trajectory folder"):
        read_trajectories(tmp_path)
    (tmp_path / "meta.json").write_text((traj_dir / "meta.json").read_text())
    with pytest.raises(DataError, match="holds no trajectory shards"):
        read_trajectories(tmp_path)
    (tmp_path / "shard-00000.safetensors").write_bytes(
        (traj_dir / "shard-00000.safetensors").read_bytes()[:100]
    )
    with pytest.raises(DataError, match="incomplete: 1 of 2 shards"):
        read_trajectories(tmp_path)
    (tmp_path / "shard-00001.safetensors").write_bytes(
        (traj_dir / "shard-00001.safetensors").read_bytes()
    )
    with pytest.raises(DataError, match="shard-00000.safetensors is truncated or corrupt"):
        read_trajectories(tmp_path)


def test_other_settings_and_long_prompts_write_nothing(lm, traj_dir, tmp_path):
    with pytest.raises(TrajectoryError, match="other settings .*gen_length"):
        write_trajectories(
            lm,
            [[5, 6, 7], [8, 9], [10, 11, 12, 13]],
            traj_dir,
            DiffusionDecodeConfig(gen_length=24, steps_per_block=8),
            shard_size=2,
        )
    out = tmp_path / "long"
    with pytest.raises(TrajectoryError, match="prompt 1: .*context is 512 positions"):
        write_trajectories(lm, [[5, 6], list(range(5, 60)) * 10], out, CFG)
    assert not out.exists()


def test_filter_recipe_learns_and_exports(traj_dir, tmp_path):
    from draftsmith.recipes.learn2pd.objective import Learn2PDObjective

    data = TrajectoryDataModule(traj_dir, batch_size=4096, val_fraction=0.0)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    torch.manual_seed(0)
    arch = Learn2PDConfig(block_length=8, threshold=0.9, steps_per_block=8)
    objective = Learn2PDObjective(Learn2PDFilter(arch), {"block_length": 8, "threshold": 0.9})
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-2)
    first, _ = objective.loss(batch, None)
    for _ in range(60):
        loss, metrics = objective.loss(batch, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.85 * first.item() and 0 <= metrics["fpr"].item() <= 1
    config = {**objective.export_config(), "target": {"name_or_path": "tiny"}}
    write_export(tmp_path / "f", objective.module.state_dict(), config)
    loaded, _ = Learn2PDFilter.from_export(tmp_path / "f", block_length=8)
    torch.testing.assert_close(loaded(batch["conf"]), objective.module(batch["conf"]))
    with pytest.raises(
        FilterMismatchError, match="trained for block length 8 but the target decodes blocks of 32"
    ):
        Learn2PDFilter.from_export(tmp_path / "f", block_length=32)
    with pytest.raises(FilterMismatchError, match="blocks of 8 slots but got 32"):
        loaded(torch.rand(1, 32))


def test_learn2pd_recipe_refuses_causal_target(traj_dir, tiny_target_dir):
    from draftsmith.distill.target.frozen import Target
    from draftsmith.recipes.learn2pd.objective import build

    cfg = recipe_config(
        "learn2pd",
        {
            "data": {"spec": str(traj_dir)},
            "filter": {"hidden": 8, "num_layers": 2, "threshold": 0.9},
        },
    )
    with pytest.raises(ConfigError, match="causal .*not a block-diffusion target"):
        build(cfg, Target.load(str(tiny_target_dir), "fp32"))
    assert json.loads((traj_dir / "meta.json").read_text())["num_prompts"] == 3


def _prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\nwhat is the answer\n")
    return prompts


def _diffusion_target_and_filter(tiny_target_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The tiny target saved as a block-diffusion folder (blocks of 8) and a Learn2PD filter export
    trained for blocks of 32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.recipes.diffusion_adapt.objective import add_mask_token
    from draftsmith.runtime.target.diffusion_lm import save_diffusion_folder

    model, tok = (
        AutoModelForCausalLM.from_pretrained(tiny_target_dir),
        AutoTokenizer.from_pretrained(tiny_target_dir),
    )
    dlm = save_diffusion_folder(
        model, tok, DiffusionSpec(8, add_mask_token(model, tok)), tmp_path / "dlm"
    )
    filt = Learn2PDFilter(Learn2PDConfig(block_length=32))
    write_export(
        tmp_path / "f32",
        filt.state_dict(),
        {
            "method": "learn2pd",
            "architecture": filt.architecture(),
            "target": {"name_or_path": "x"},
        },
    )
    return dlm, tmp_path / "f32"


def test_cli_refuses_causal_target_and_foreign_filter(tiny_target_dir, tmp_path, capsys):
    from draftsmith import cli

    prompts = _prompts(tmp_path)
    out = tmp_path / "traj"
    rc = cli.main(
        [
            "trajectories",
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
        ]
    )
    assert (
        rc == 2
        and "causal (autoregressive) LM, not a block-diffusion target" in capsys.readouterr().err
    )
    assert not out.exists()
    dlm, filter_export = _diffusion_target_and_filter(tiny_target_dir, tmp_path)
    # `draftsmith bench --target DLM [--filter EXPORT]` is the one block-diffusion bench, with a
    # markdown twin
    rc = cli.main(
        [
            "bench",
            "--target",
            str(dlm),
            "--filter",
            str(filter_export),
            "--prompts",
            str(prompts),
            "--gen-length",
            "16",
        ]
    )
    assert (
        rc == 2
        and "trained for block length 32 but the target decodes blocks of 8"
        in capsys.readouterr().err
    )
    for bad in (
        ["--threshold", "0.5"],
        ["--filter", str(filter_export), "--threshold", "1.5"],
    ):  # before loading
        rc = cli.main(
            ["bench", "--target", str(dlm), "--prompts", str(prompts), "--gen-length", "16", *bad]
        )
        assert (
            rc == 2
            and "needs --filter EXPORT and a value strictly between 0 and 1"
            in capsys.readouterr().err
        )


def test_the_diffusion_bench_with_the_cache_writes_its_table(tiny_target_dir, tmp_path):
    from draftsmith import cli

    dlm, _ = _diffusion_target_and_filter(tiny_target_dir, tmp_path)
    rc = cli.main(
        [
            "bench",
            "--target",
            str(dlm),
            "--prompts",
            str(_prompts(tmp_path)),
            "--gen-length",
            "16",
            "--cache",
            "on",
            "--out",
            str(tmp_path / "bench"),
        ]
    )
    table = (tmp_path / "bench" / "diffusion_bench.md").read_text()
    assert rc == 0 and "| baseline+cache |" in table and "| eotp+cache |" in table
    assert (
        json.loads((tmp_path / "bench" / "diffusion_bench.json").read_text())["rows"][0][
            "same_as_baseline"
        ]
        == 1.0
    )


def test_task_accuracy_counts_only_checkable_prompts():
    from draftsmith.evals.diffusion import add_task_accuracy, markdown_table

    records = [
        {"text": "What is 2 + 3?", "answer": "5"},
        {"text": "Continue: The cat", "answer": None},
        {"text": "Repeat this word exactly: apple", "answer": "apple"},
    ]
    words = {1: "The answer is 5.", 2: "a cat", 3: "pear", 4: "apple"}
    result = {
        "rows": [{"mode": "baseline"}, {"mode": "eotp"}],
        "answers": {"baseline": [[1], [2], [3]], "eotp": [[1], [2], [4]]},
    }
    add_task_accuracy(result, records, lambda ids: words[ids[0]])
    assert [r["task_accuracy"] for r in result["rows"]] == [0.5, 1.0] and result[
        "checkable_prompts"
    ] == 2
    for row in result["rows"]:
        row.update(
            tokens_per_s=1,
            steps_per_block=1,
            forwards_per_token=1,
            speedup=1,
            step_reduction=1,
            same_as_baseline=1,
            agreed_prefix=1,
        )
    assert "task accuracy |" in markdown_table(result).splitlines()[0]


def test_agreed_prefix_measures_the_share_before_the_first_difference():
    from draftsmith.evals.diffusion import agreed_prefix

    base = [[1, 2, 3, 4], [5, 6], [7, 8]]
    assert agreed_prefix(base, base) == 1.0
    # 2 of 4 tokens before the difference; a longer answer agrees on 2 of its 3; an empty one on
    # none
    assert agreed_prefix([[1, 2, 9, 4], [5, 6, 0], []], base) == pytest.approx(
        (2 / 4 + 2 / 3 + 0) / 3
    )
    # two empty answers (an EoT at the first slot) are the same answer
    assert agreed_prefix([[]], [[]]) == 1.0
