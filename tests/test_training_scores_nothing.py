"""Training stops with one actionable line when it scores nothing: EAGLE-3 whose draft vocabulary
never holds the target's argmax, loss masks that select no token, a loss stuck at exactly zero, and
EAGLE-3's default taps on targets too shallow for them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from test_training_refusals import run_train_inprocess, tiny_overrides

from draftsmith.cli.training import compose_config
from draftsmith.common.errors import ConfigError
from draftsmith.distill.target.frozen import FeatureTaps, Target

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


# -------------------------------------------------------------------------- runs that score nothing


@pytest.fixture(scope="module")
def argmax_outside_data_target(tmp_path_factory, tiny_tokenizer) -> Path:
    """A Qwen2-like tiny target (untied head, a vocabulary padded past the tokenizer's) whose argmax
    is always its last id, a padding id past the tokenizer that no assistant reply contains: every
    embedding carries a large constant component, and only the last row of the LM head reads it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tiny_tokenizer) + 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=1,
        eos_token_id=3,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(100.0)
        model.lm_head.weight[-1] = 1.0
    path = tmp_path_factory.mktemp("qwen2_argmax0")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_eagle3_whose_draft_vocabulary_never_holds_the_argmax_stops_at_the_first_batches(
    tmp_path, monkeypatch, argmax_outside_data_target, tiny_data_file
):
    from draftsmith.distill.engine.callbacks.guards import NothingScoredError

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    overrides = [
        "recipe=eagle3",
        *tiny_overrides(argmax_outside_data_target, tiny_data_file),
        "trainer.max_steps=40",
        "drafter.draft_vocab_size=16",
        "drafter.ttt_steps=1",
    ]
    # drafter.target_layers stays null: a 4-layer target gets the default taps spread over its
    # layers
    with pytest.raises(NothingScoredError) as err:
        run_train_inprocess(overrides, tmp_path / "run")
    message = str(err.value)
    # read on the first log step once four batches are in (trainer.log_every_n_steps=5 here: step 4)
    assert (
        "first 4 training batch(es) score no position" in message
        and "stopping at step 4" in message
    ), message
    assert "draft vocabulary" in message and "drafter.draft_vocab_size=16" in message, message
    assert not (tmp_path / "run" / "export").exists()  # nothing exported


class ScriptedObjective:
    """Objective stand-in whose loss is scripted (value, scored count)."""

    def __new__(cls, losses, scored=None, reason=None):
        from draftsmith.distill.engine.objective import Objective

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
    from draftsmith.distill.engine.module import DistillModule

    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    module = DistillModule(
        objective, target, {"lr": 1e-3}, total_steps=total_steps, zero_loss_patience=patience
    )
    module._trainer = SimpleNamespace(
        global_step=0, checkpoint_callbacks=[], log_every_n_steps=1, max_steps=total_steps
    )
    module.log = module.log_dict = lambda *a, **k: None
    return module


def train_step(module, batch, step):
    """One training step as Lightning runs it: the step, the optimizer's global-step count, the
    guards' batch end (every step is a log step here, so they read their record each time)."""
    from draftsmith.distill.engine.callbacks.guards import TrainingGuards

    module._trainer.global_step = step
    module.training_step(batch, step)
    module._trainer.global_step = step + 1
    TrainingGuards(module.guards).on_train_batch_end(module._trainer, module, None, batch, step)


def batch(loss_mask_value: int):
    ids = torch.randint(5, 20, (2, 6))
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.full_like(ids, loss_mask_value),
    }


def test_loss_masks_that_select_nothing_stop_at_the_first_batches(tiny_tokenizer):
    from draftsmith.distill.engine.callbacks.guards import NothingScoredError

    module = scripted_module(ScriptedObjective([1.0]), tiny_tokenizer)
    for i in range(3):
        train_step(module, batch(0), i)  # empty masks so far: not yet decided
    with pytest.raises(
        NothingScoredError,
        match=r"first 4 training batch\(es\) score no position \(their loss "
        r"masks select no token.*data\.max_length",
    ):
        train_step(module, batch(0), 3)

    # one scoring batch among the first four is enough, and later empty batches are never checked
    fine = scripted_module(ScriptedObjective([1.0]), tiny_tokenizer)
    for i, value in enumerate([0, 0, 1, 0, 0, 0, 0, 0]):
        train_step(fine, batch(value), i)
    # a run shorter than four steps is checked at its last step
    short = scripted_module(ScriptedObjective([1.0]), tiny_tokenizer, total_steps=1)
    with pytest.raises(NothingScoredError, match="first 1 training batch"):
        train_step(short, batch(0), 0)
    # an objective's own count (a tensor, as EAGLE-3 keeps it; and its reason) wins over the loss
    # mask
    own = scripted_module(
        ScriptedObjective([1.0], scored=torch.tensor(0.0), reason="my reason"),
        tiny_tokenizer,
        total_steps=2,
    )
    train_step(own, batch(1), 0)
    with pytest.raises(NothingScoredError, match=r"\(my reason\)"):
        train_step(own, batch(1), 1)


def test_a_loss_of_exactly_zero_for_patience_steps_stops(tiny_tokenizer):
    from draftsmith.distill.config.schema import RunConfig
    from draftsmith.distill.engine.callbacks.guards import ZeroLossError

    assert RunConfig().zero_loss_patience == 5  # the default every recipe trains with
    module = scripted_module(
        ScriptedObjective([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), tiny_tokenizer, patience=3
    )
    for i in range(5):  # the 1.0 at step 2 resets the count
        train_step(module, batch(1), i)
    with pytest.raises(
        ZeroLossError,
        match=r"exactly 0\.0 for 3 consecutive steps \(up to step 5\).*"
        r"run\.zero_loss_patience=0",
    ):
        train_step(module, batch(1), 5)
    off = scripted_module(ScriptedObjective([0.0]), tiny_tokenizer, patience=0)
    for i in range(8):
        train_step(off, batch(1), i)
    with pytest.raises(
        ConfigError, match=r"run\.zero_loss_patience=-1 is out of range: allowed >= 0"
    ):
        from draftsmith import recipes
        from draftsmith.distill.engine.trainer import check_config

        check_config(
            compose_config(["recipe=medusa", "run.zero_loss_patience=-1"]),
            recipes.get_recipe("medusa"),
        )


def test_guards_read_nothing_on_steps_that_are_not_log_steps(tiny_tokenizer):
    """A non-finite loss at step 1 is kept on the device and reported, with its step, at the next
    log step (3)."""
    from draftsmith.distill.engine.callbacks.guards import NonFiniteLossError, TrainingGuards

    module = scripted_module(ScriptedObjective([1.0, float("nan"), 2.0, 2.0]), tiny_tokenizer)
    module._trainer.log_every_n_steps = 4
    reads = []
    real_check = module.guards.check
    module.guards.check = lambda *a, **k: (reads.append(a[1]), real_check(*a, **k))
    for i in range(3):
        train_step(module, batch(1), i)
    assert reads == []  # steps 0-2 are not log steps: no read-back
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 1"):
        train_step(module, batch(1), 3)
    assert reads == [3]
    # a checkpoint written between log steps reads the record first: no weights after a NaN are
    # saved
    saving = scripted_module(ScriptedObjective([float("inf")]), tiny_tokenizer)
    saving._trainer.log_every_n_steps = 50
    train_step(saving, batch(1), 0)
    with pytest.raises(NonFiniteLossError, match="loss is inf at step 0"):
        TrainingGuards(saving.guards).on_save_checkpoint(saving._trainer, saving, {})


def test_nonfinite_loss_before_any_checkpoint_says_none_was_written(tmp_path, tiny_tokenizer):
    from pytorch_lightning.callbacks import ModelCheckpoint

    from draftsmith.distill.engine.callbacks.guards import NonFiniteLossError, TrainingGuards
    from draftsmith.distill.engine.module import DistillModule
    from draftsmith.distill.engine.objective import Objective

    class NanObjective(Objective):
        module = torch.nn.Linear(2, 2)
        taps = FeatureTaps()

        def loss(self, batch, feats):
            return torch.tensor(float("nan")), {}

    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    module = DistillModule(NanObjective(), target, {"lr": 1e-3}, total_steps=10)
    callback = ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"))
    module._trainer = trainer = SimpleNamespace(
        global_step=0, checkpoint_callbacks=[callback], log_every_n_steps=1, max_steps=10
    )
    module.log = module.log_dict = lambda *a, **k: None
    ids = torch.randint(5, 20, (1, 6))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    module.training_step(batch, 0)
    trainer.global_step, guards = (
        1,
        TrainingGuards(module.guards),
    )  # read at the step's end (a log step)
    with pytest.raises(NonFiniteLossError) as err:
        guards.on_train_batch_end(trainer, module, None, batch, 0)
    assert (
        "loss is nan at step 0" in str(err.value)
        and "no checkpoint was written yet" in str(err.value).lower()
    )
    assert "intact" not in str(err.value)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")  # a resumed run's checkpoint
    with pytest.raises(NonFiniteLossError, match="last good checkpoint is intact: .*last.ckpt"):
        guards.on_train_batch_end(trainer, module, None, batch, 0)


def test_eagle3_default_taps_adapt_to_shallow_targets(tiny_tokenizer):
    from draftsmith.drafters.eagle3 import default_target_layers
    from draftsmith.recipes import get_recipe

    assert [default_target_layers(n) for n in (3, 4, 5, 6, 7, 8, 32)] == [
        (0, 1, 2),
        (1, 2, 3),
        (1, 2, 4),
        (1, 3, 5),
        (2, 3, 4),
        (2, 4, 5),
        (2, 16, 29),
    ]
    cfg = compose_config(["recipe=eagle3", "drafter.draft_vocab_size=0"])
    four = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    eagle3 = get_recipe("eagle3")
    assert eagle3.build(cfg, four).taps.layers == (1, 2, 3)
    two = Target(build_tiny_llama(len(tiny_tokenizer), num_hidden_layers=2), tiny_tokenizer, "tiny")
    with pytest.raises(ConfigError, match=r"2-layer target .*drafter\.target_layers") as err:
        eagle3.build(cfg, two)
    assert "\n" not in str(err.value)
