"""Training refuses nonsense with one actionable line: runs that score no position (EAGLE-3 whose draft vocabulary
never holds the target's argmax, empty loss masks), a loss stuck at exactly zero, EAGLE-3's taps on shallow
targets, bad optimizer values, missing or damaged targets, binary or missing data, unknown ``+key`` overrides,
Ctrl-C (where the checkpoint is, how to resume, exit 130) and rollout prompts longer than data.max_length."""

from __future__ import annotations

import json
import logging
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from omegaconf import OmegaConf

from draftsmith.cli.training import compose_config
from draftsmith.distill.errors import ConfigError, DataError, DataFileNotFoundError, TrainingInterrupted
from draftsmith.distill.target import FeatureTaps, Target

ROOT = Path(__file__).resolve().parents[1]


def tiny_overrides(target_dir: Path, data_file: Path, *more: str) -> list[str]:
    return [f"target.name_or_path={target_dir}", "target.dtype=fp32", f"data.spec={data_file}", "data.limit=null",
            "data.max_length=48", "data.batch_size=4", "data.val_fraction=0.1", "run.final_eval_batches=1",
            "run.checkpoint_every=1000", "logger=csv", *more]


def run_train_inprocess(overrides: list[str], run_dir: Path):
    from draftsmith import recipes
    from draftsmith.distill.trainer import train

    cfg = compose_config(overrides)
    return train(cfg, recipes.get_recipe(cfg.recipe.name), run_dir)


def train_main(argv: list[str], tmp_path: Path, monkeypatch, env: dict | None = None) -> int | None:
    """train.py as a script, in-process; its exit status."""
    monkeypatch.setattr(sys, "argv", ["train.py", *argv, f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    for key in ("HYDRA_FULL_ERROR", "DRAFTSMITH_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    return ended.value.code


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# --------------------------------------------------------------------------- 1. runs that score nothing


@pytest.fixture(scope="module")
def argmax_outside_data_target(tmp_path_factory, tiny_tokenizer) -> Path:
    """A Qwen2-like tiny target (untied head, a vocabulary padded past the tokenizer's) whose argmax is always its last
    id, a padding id past the tokenizer that no assistant reply contains: every embedding carries a large constant
    component, and only the last row of the LM head reads it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tiny_tokenizer) + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=1, eos_token_id=3)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(100.0)
        model.lm_head.weight[-1] = 1.0
    path = tmp_path_factory.mktemp("qwen2_argmax0")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_eagle3_whose_draft_vocabulary_never_holds_the_argmax_stops_at_the_first_batches(
        tmp_path, monkeypatch, argmax_outside_data_target, tiny_data_file):
    from draftsmith.distill.module import NothingScoredError

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    overrides = ["recipe=eagle3", *tiny_overrides(argmax_outside_data_target, tiny_data_file),
                 "trainer.max_steps=40", "drafter.draft_vocab_size=16", "drafter.ttt_steps=1"]
    # drafter.target_layers stays null: a 4-layer target gets the default taps spread over its layers
    with pytest.raises(NothingScoredError) as err:
        run_train_inprocess(overrides, tmp_path / "run")
    message = str(err.value)
    assert "first 4 training batch(es) score no position" in message and "step 3" in message, message
    assert "draft vocabulary" in message and "drafter.draft_vocab_size=16" in message, message
    assert not (tmp_path / "run" / "export").exists()  # nothing exported


class ScriptedObjective:
    """Objective stand-in whose loss is scripted (value, scored count)."""

    def __new__(cls, losses, scored=None, reason=None):
        from draftsmith.distill.objective import Objective

        class Scripted(Objective):
            module = torch.nn.Linear(2, 2)
            taps = FeatureTaps()

            def __init__(self):
                self.calls = 0

            def features(self, target, batch):
                return None

            def loss(self, batch, feats):
                value = losses[min(self.calls, len(losses) - 1)]
                if scored is not None:
                    self.last_scored, self.unscored_reason = scored, reason
                self.calls += 1
                return self.module.weight.sum() * 0 + value, {}

        return Scripted()


def scripted_module(objective, tiny_tokenizer, total_steps=100, patience=5):
    from draftsmith.distill.module import DistillModule

    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    module = DistillModule(objective, target, {"lr": 1e-3}, total_steps=total_steps, zero_loss_patience=patience)
    module._trainer = SimpleNamespace(global_step=0, checkpoint_callbacks=[])
    module.log = module.log_dict = lambda *a, **k: None
    return module


def batch(loss_mask_value: int):
    ids = torch.randint(5, 20, (2, 6))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.full_like(ids, loss_mask_value)}


def test_loss_masks_that_select_nothing_stop_at_the_first_batches(tiny_tokenizer):
    from draftsmith.distill.module import NothingScoredError

    module = scripted_module(ScriptedObjective([1.0]), tiny_tokenizer)
    for i in range(3):
        module.training_step(batch(0), i)  # empty masks so far: not yet decided
    with pytest.raises(NothingScoredError, match=r"first 4 training batch\(es\) score no position \(their loss "
                                                 r"masks select no token.*data\.max_length"):
        module.training_step(batch(0), 3)

    # one scoring batch among the first four is enough, and later empty batches are never checked
    fine = scripted_module(ScriptedObjective([1.0]), tiny_tokenizer)
    for i, value in enumerate([0, 0, 1, 0, 0, 0, 0, 0]):
        fine.training_step(batch(value), i)
    # a run shorter than four steps is checked at its last step
    short = scripted_module(ScriptedObjective([1.0]), tiny_tokenizer, total_steps=1)
    with pytest.raises(NothingScoredError, match="first 1 training batch"):
        short.training_step(batch(0), 0)
    # an objective's own count (and reason) wins over the loss mask
    own = scripted_module(ScriptedObjective([1.0], scored=0, reason="my reason"), tiny_tokenizer, total_steps=2)
    own.training_step(batch(1), 0)
    own._trainer.global_step = 1
    with pytest.raises(NothingScoredError, match=r"\(my reason\)"):
        own.training_step(batch(1), 1)


def test_a_loss_of_exactly_zero_for_patience_steps_stops(tiny_tokenizer):
    from draftsmith.distill.module import ZeroLossError

    assert OmegaConf.load(ROOT / "conf/train.yaml").run.zero_loss_patience == 5
    module = scripted_module(ScriptedObjective([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), tiny_tokenizer, patience=3)
    for i in range(5):  # the 1.0 at step 2 resets the count
        module._trainer.global_step = i
        module.training_step(batch(1), i)
    module._trainer.global_step = 5
    with pytest.raises(ZeroLossError, match=r"exactly 0\.0 for 3 consecutive steps \(up to step 5\).*"
                                            r"run\.zero_loss_patience=0"):
        module.training_step(batch(1), 5)
    off = scripted_module(ScriptedObjective([0.0]), tiny_tokenizer, patience=0)
    for i in range(8):
        off.training_step(batch(1), i)
    with pytest.raises(ConfigError, match="run.zero_loss_patience must be >= 0"):
        from draftsmith import recipes
        from draftsmith.distill.trainer import check_config

        check_config(compose_config(["recipe=medusa", "run.zero_loss_patience=-1"]), recipes.get_recipe("medusa"))


def test_eagle3_default_taps_adapt_to_shallow_targets(tiny_tokenizer):
    from draftsmith.drafters.eagle3 import default_target_layers
    from draftsmith.recipes import eagle3

    assert [default_target_layers(n) for n in (3, 4, 5, 6, 7, 8, 32)] == [
        (0, 1, 2), (1, 2, 3), (1, 2, 4), (1, 3, 5), (2, 3, 4), (2, 4, 5), (2, 16, 29)]
    cfg = compose_config(["recipe=eagle3", "drafter.draft_vocab_size=0"])
    four = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    assert eagle3.build(cfg, four).taps.layers == (1, 2, 3)
    two = Target(build_tiny_llama(len(tiny_tokenizer), num_hidden_layers=2), tiny_tokenizer, "tiny")
    with pytest.raises(ConfigError, match=r"2-layer target .*drafter\.target_layers") as err:
        eagle3.build(cfg, two)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- 2. one actionable line each


def test_a_learning_rate_that_is_not_positive_is_refused_before_loading():
    from draftsmith import recipes
    from draftsmith.distill.trainer import check_config

    medusa = recipes.get_recipe("medusa")
    for bad, match in (("optim.lr=-1e-3", r"optim\.lr=-0\.001 must be a positive number"),
                       ("optim.lr=0", r"optim\.lr=0 must be a positive"),
                       ("optim.weight_decay=-1", r"optim\.weight_decay=-1 must be >= 0"),
                       ("optim.betas=[0.9,1.5]", r"optim\.betas=\[0\.9, 1\.5\] must be two numbers in \[0, 1\)")):
        with pytest.raises(ConfigError, match=match):
            check_config(compose_config(["recipe=medusa", bad]), medusa)


@pytest.mark.e2e  # a train.py subprocess: the exit status and stderr a user sees
def test_train_py_negative_lr_is_one_line_and_exit_1(tmp_path, tiny_target_dir, tiny_data_file):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "recipe=medusa", f"target={tiny_target_dir}",
                           f"data={tiny_data_file}", "optim.lr=-1e-3", f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: optim.lr=-0.001 must be a positive number (e.g. optim.lr=1e-3)"], proc.stderr[-3000:]


def test_missing_or_damaged_targets_are_named_in_one_line(tmp_path, tiny_target_dir):
    import shutil

    with pytest.raises(ConfigError, match=r"^target\.name_or_path=/nonexistent/model: does not exist; point target="):
        Target.load("/nonexistent/model", "fp32")
    bad_config = tmp_path / "bad_config"
    shutil.copytree(tiny_target_dir, bad_config)
    (bad_config / "config.json").write_text('{"model_type": "llama", oops')
    with pytest.raises(ConfigError, match=rf"target file {bad_config}/config\.json is not valid JSON"):
        Target.load(str(bad_config), "fp32")
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_target_dir, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ConfigError, match=rf"target file {truncated}/model\.safetensors is damaged: it is truncated"):
        Target.load(str(truncated), "fp32")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_target_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=rf"target folder {no_weights}: .*model\.safetensors"):
        Target.load(str(no_weights), "fp32")


def test_train_py_reports_a_missing_target_as_one_line(tmp_path, monkeypatch, capsys, tiny_data_file):
    assert train_main(["recipe=medusa", "target.name_or_path=/nonexistent", f"data.spec={tiny_data_file}"],
                      tmp_path, monkeypatch) == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("error: target.name_or_path=/nonexistent: does not exist"), lines


def test_binary_and_missing_data_are_named(tmp_path):
    from draftsmith.distill.conversations import load_conversations

    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(DataError, match=rf"data file {binary} is binary, not JSON text"):
        load_conversations(str(binary))
    parquet = tmp_path / "table.jsonl"
    parquet.write_bytes(b"PAR1" + bytes(range(256)))
    with pytest.raises(DataError, match=r"it is a parquet file: rename it to \.parquet"):
        load_conversations(str(parquet))
    late = tmp_path / "late.jsonl"  # valid first lines, then bytes that are not UTF-8
    late.write_bytes(b'{"conversations": []}\n' * 300 + b"\xff\xfe\xfd\n")
    with pytest.raises(DataError, match=rf"data file {late} is not UTF-8 text"):
        load_conversations(str(late))
    missing = tmp_path / "no_such_chats"
    with pytest.raises(DataFileNotFoundError, match=rf"^data path {missing} does not exist"):
        load_conversations(str(missing))
    with pytest.raises(DataFileNotFoundError, match="does not exist"):
        load_conversations("./no_such_folder_here")


def test_unknown_plus_keys_are_refused_with_close_matches(tmp_path, monkeypatch, capsys):
    from draftsmith.train import unknown_added_keys

    cfg = compose_config(["recipe=medusa", "+heads.num_head=4"])
    message = unknown_added_keys(cfg, ["+heads.num_head=4"])
    assert message.startswith("+heads.num_head=4 adds a key that no config of recipe=medusa reads; did you mean "
                              "heads.num_heads?"), message
    assert "heads.num_heads=4" in message
    cfg = compose_config(["recipe=eagle", "+drafter.noise_std=0.2", "+trainer.fsdp_opts=1"])
    assert unknown_added_keys(cfg, ["+drafter.noise_std=0.2", "hydra/launcher=basic"]) is None  # read by eagle
    assert "see conf/" in unknown_added_keys(cfg, ["+trainer.fsdp_opts=1"])

    from draftsmith.distill import trainer

    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("training must not start"))
    assert train_main(["recipe=medusa", "+heads.num_head=4"], tmp_path, monkeypatch) == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("error: +heads.num_head=4 adds a key") and "heads.num_heads" in \
        lines[0], lines


def test_medusa_draft_vocab_warning_names_the_heads_key(tmp_path, monkeypatch, caplog, tiny_tokenizer,
                                                        tiny_data_file):
    from draftsmith.recipes.medusa import medusa_draft_ids

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    cfg = compose_config(["recipe=medusa", f"data.spec={tiny_data_file}", "data.max_length=48",
                          "heads.draft_vocab_size=100"])
    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    with caplog.at_level(logging.WARNING):
        ids = medusa_draft_ids(cfg, target)
    assert ids.numel() == 100
    warned = [r.getMessage() for r in caplog.records if "distinct assistant tokens" in r.getMessage()]
    assert len(warned) == 1 and "lower heads.draft_vocab_size" in warned[0] and "drafter." not in warned[0], warned


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_training_names_the_checkpoint_and_the_resume_command(tmp_path, monkeypatch, tiny_target_dir,
                                                                         tiny_data_file):
    from draftsmith.distill.module import DistillModule

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    step = DistillModule.training_step

    def interrupted_at_3(self, batch, batch_idx):
        if self.global_step == 3:
            raise KeyboardInterrupt
        return step(self, batch, batch_idx)

    monkeypatch.setattr(DistillModule, "training_step", interrupted_at_3)
    overrides = ["recipe=medusa", *tiny_overrides(tiny_target_dir, tiny_data_file), "trainer.max_steps=10",
                 "run.checkpoint_every=2"]
    import signal

    with pytest.raises(TrainingInterrupted) as err:
        run_train_inprocess(overrides, tmp_path / "run")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards
    assert err.value.step == 3 and err.value.checkpoint.endswith("step2.ckpt"), vars(err.value)
    assert isinstance(err.value, KeyboardInterrupt)


def test_train_py_reports_ctrl_c_with_exit_130(tmp_path, monkeypatch, capsys):
    from draftsmith.distill import trainer

    ckpt = tmp_path / "checkpoints" / "step50.ckpt"

    def interrupted(*args, **kwargs):
        raise TrainingInterrupted(57, str(ckpt), str(tmp_path), 50)

    monkeypatch.setattr(trainer, "train", interrupted)
    assert train_main(["recipe=medusa", "optim.lr=2e-3", "run.resume=false"], tmp_path, monkeypatch) == 130
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert re.match(rf"error: interrupted \(Ctrl-C\) at step 57; the last checkpoint is {re.escape(str(ckpt))}; "
                    r"resume with: python \S*train\.py recipe=medusa optim\.lr=2e-3 hydra\.run\.dir=", lines[0]), lines
    assert "run.resume=false" not in lines[0]

    def interrupted_early(*args, **kwargs):  # Ctrl-C before the first checkpoint (or while loading)
        raise TrainingInterrupted(3, None, str(tmp_path / "fresh"), 50)

    monkeypatch.setattr(trainer, "train", interrupted_early)
    assert train_main(["recipe=medusa"], tmp_path / "fresh", monkeypatch) == 130
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "no checkpoint was written yet (the first comes after run.checkpoint_every=50 " \
                                "steps)" in lines[0], lines
    assert re.search(r"start again with: python \S*train\.py recipe=medusa", lines[0]), lines
    # DRAFTSMITH_DEBUG=1 keeps the traceback
    with pytest.raises(KeyboardInterrupt):
        train_main(["recipe=medusa"], tmp_path / "fresh", monkeypatch, env={"DRAFTSMITH_DEBUG": "1"})


# --------------------------------------------------------------------------- rollouts longer than data.max_length


def test_rollout_prompts_longer_than_max_length_are_skipped_and_reported(tmp_path, caplog):
    from draftsmith.datagen.rollouts import DEFAULT_TRAIN_MAX_LENGTH, length_warning
    from draftsmith.distill.preference_data import PreferenceDataModule

    assert DEFAULT_TRAIN_MAX_LENGTH == OmegaConf.load(ROOT / "conf/data/sharegpt.yaml").max_length
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"grid": [0.0, 1.0], "granularity": "sequence",
                                                  "max_new_tokens": 8, "target": "tiny"}))
    sample = {"tokens": [7, 8, 9], "temps": [0, 0, 0], "reward": 1.0}
    rows = [{"prompt_index": i, "kind": "k", "prompt_ids": list(range(5, 5 + n)),
             "samples": [sample, {**sample, "reward": 0.0}], "chosen": 0, "rejected": 1}
            for i, n in enumerate([10, 30, 12, 40, 11, 9])]
    (folder / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    data = PreferenceDataModule(folder, batch_size=2, max_length=24, pad_id=0, val_fraction=0.2)
    with caplog.at_level(logging.WARNING, logger="draftsmith.distill.preference_data"):
        data.setup("fit")
    assert len(data.train_set) + len(data.val_set) == 4
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(f"2 of 6 rollout pair(s) of {folder} have a prompt of "
                                                     "data.max_length=24 tokens or more (the longest 40)"), warned
    assert "data.max_length=48 keeps them all" in warned[0]
    next(iter(data.train_dataloader()))  # the kept pairs batch fine

    with pytest.raises(DataError, match=r"6 of 6 rollout pair\(s\).*nothing left to train on; set "
                                        r"data\.max_length=48"):
        PreferenceDataModule(folder, batch_size=2, max_length=9, pad_id=0).setup("fit")

    assert length_warning([10, 20], 8) is None
    text = length_warning([268, 100, 250], 64)
    assert text.startswith("warning: 1 of 3 prompt(s) have 256+ tokens (the longest 268)") and \
        "1 prompt(s) + --max-new-tokens 64 exceed it" in text and "data.max_length=332" in text, text


def test_rollouts_warn_about_long_prompts_before_sampling(tmp_path, monkeypatch, capsys, tiny_target_dir):
    from draftsmith.datagen import rollouts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": " ".join(["hello world"] * 140)}) + "\n")

    monkeypatch.setattr(rollouts, "write_rollouts", lambda *a, **k: {"stopped": True})
    assert rollouts.main(["--target", str(tiny_target_dir), "--prompts", str(prompts), "--out",
                          str(tmp_path / "out"), "--no-progress", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 of 1 prompt(s) have 256+ tokens" in err and "training skips them" in err, err
