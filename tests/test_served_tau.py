"""Serving-faithful validation: served tau (the runtime's own greedy speculative loop on held-out
prompts) is logged next to the training accuracy and written into the export, tells a drafter whose
serving alignment is broken from a good one while training accuracy cannot, and equals the bench's
tau on the same prompts."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pattern_target import train_pattern_target, write_heldout_prompts

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "target.dtype=fp32",
    "data.limit=null",
    "data.max_length=48",
    "data.batch_size=4",
    "data.val_fraction=0.1",
    "run.final_eval_batches=1",
    "heads.draft_vocab_size=null",
    "validation.served_tau.dtype=fp32",
]


@pytest.fixture(scope="module")
def pattern_target(tmp_path_factory) -> Path:
    return train_pattern_target(tmp_path_factory.mktemp("pattern_target"))


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    return write_heldout_prompts(tmp_path_factory.mktemp("prompts") / "heldout.jsonl")


def train_medusa(
    target: Path,
    data: Path,
    prompts: Path,
    run_dir: Path,
    steps: int,
    probe=None,
    overrides: tuple[str, ...] = (),
):
    """``distill.trainer.train`` in-process (recipe=medusa on the tiny target), with the served-tau
    probe train.py builds from ``validation.served_tau`` unless ``probe`` is given."""
    from draftsmith.cli.training import compose_config
    from draftsmith.distill.engine.trainer import train
    from draftsmith.recipes import get_recipe
    from draftsmith.train import served_probe

    cfg = compose_config(
        [
            "recipe=medusa",
            f"target.name_or_path={target}",
            f"data.spec={data}",
            *TINY,
            f"validation.served_tau.prompt_set={prompts}",
            f"trainer.max_steps={steps}",
            "optim.lr=3e-3",
            "optim.warmup_steps=0",
            "run.checkpoint_every=1000",
            *overrides,
        ]
    )
    return train(
        cfg,
        get_recipe("medusa"),
        run_dir,
        served_probe=served_probe(cfg) if probe is None else probe,
    )


@pytest.mark.e2e
def test_train_py_logs_served_tau_beside_accuracy_and_writes_it_into_the_export(
    tmp_path, tiny_target_dir, tiny_data_file, heldout
):
    run_dir = tmp_path / "run"
    overrides = [
        "recipe=medusa",
        f"target.name_or_path={tiny_target_dir}",
        f"data.spec={tiny_data_file}",
        *TINY,
        f"validation.served_tau.prompt_set={heldout}",
        "validation.served_tau.max_new_tokens=8",
        "trainer.max_steps=4",
        "run.val_every=2",
        "run.checkpoint_every=4",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(run_dir / "logs" / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("val/served_tau")]
    assert len(rows) >= 2  # the pass at step 2 and the final one
    assert all(
        r["val/head0/top1"] != "" and float(r["val/served_tau"]) >= 1.0 for r in rows
    )  # beside accuracy
    config = json.loads((run_dir / "export" / "config.json").read_text())
    validation = config["validation"]
    assert validation["served_tau"] == pytest.approx(float(rows[-1]["val/served_tau"]))
    assert (
        validation["prompts"] == 4 and validation["max_new_tokens"] == 8 and validation["step"] == 4
    )
    assert validation["prompt_set"] == str(heldout) and validation["verify_steps"] >= 4
    # the checkpoint keeps the last probe too, so `draftsmith export RUN` writes it
    from draftsmith.distill.engine.exporting import export_from_checkpoint

    again = json.loads(
        (export_from_checkpoint(run_dir, tmp_path / "again") / "config.json").read_text()
    )
    assert again["validation"]["served_tau"] >= 1.0 and again["validation"]["step"] in (2, 4)


class LateFeatures:
    """A serving bug on purpose: the loop hands the drafter each feature row one position late (row
    t-1 where row t belongs), in the prompt, at every accepted path and for the root. Training never
    sees it."""

    def __init__(self, inner) -> None:
        self.inner, self.true_last, self.late_last = inner, {}, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _late(self, key: str, rows: torch.Tensor | None) -> torch.Tensor | None:
        if rows is None:
            return None
        late = torch.cat(
            [self.true_last.get(key, rows[:1]), rows[:-1]]
        )  # [n, F]: row t holds row t-1
        self.true_last[key], self.late_last[key] = rows[-1:], late[-1]
        return late

    def begin(self, ctx):
        self.true_last, self.late_last = {}, {}
        self.inner.begin(
            replace(ctx, hidden=self._late("hidden", ctx.hidden), taps=self._late("taps", ctx.taps))
        )

    def propose(self, ctx):
        return self.inner.propose(replace(ctx, hidden=self.late_last["hidden"]))

    def accept(self, ctx):
        self.inner.accept(
            replace(ctx, hidden=self._late("hidden", ctx.hidden), taps=self._late("taps", ctx.taps))
        )


def test_broken_serving_alignment_gets_a_low_served_tau_while_training_accuracy_stays_high(
    tmp_path, pattern_target, tiny_data_file, heldout, monkeypatch
):
    from draftsmith.evals import served_tau
    from draftsmith.export.stacking import export_fingerprint

    summary = train_medusa(pattern_target, tiny_data_file, heldout, tmp_path / "run", steps=40)
    accuracy = summary["metrics"]["val/head0/top1"]
    good = summary["served_validation"]["served_tau"]
    assert accuracy >= 0.7 and good >= 2.5, (
        accuracy,
        good,
    )  # trained: the heads agree and the runtime accepts
    weights = export_fingerprint(summary["export"])
    probe = served_tau.ServedTauProbe(prompt_set=str(heldout), dtype="fp32")
    assert probe(summary["export"])["served_tau"] == pytest.approx(
        good
    )  # the same probe, the same weights
    real = served_tau.load_runtime

    def misaligned(*args, **kwargs):
        runtime = real(*args, **kwargs)
        runtime.speculative.proposer = LateFeatures(runtime.speculative.proposer)
        return runtime

    monkeypatch.setattr(served_tau, "load_runtime", misaligned)
    broken = probe(summary["export"])["served_tau"]
    print(
        f"head-0 top-1 {accuracy:.3f}; served tau {good:.3f} aligned, {broken:.3f} one position off"
    )
    # the same weights (so the same training accuracy), served one position off: tau collapses
    # towards 1
    assert export_fingerprint(summary["export"]) == weights
    assert broken < 1.6 and broken < 0.5 * good, (broken, good)


def test_served_tau_equals_the_bench_tau_on_the_same_prompts(
    tmp_path, pattern_target, tiny_data_file, heldout
):
    from draftsmith.bench.prompts import load_prompts
    from draftsmith.bench.run import run_bench
    from draftsmith.evals.served_tau import ServedTauProbe
    from draftsmith.runtime.serving import load_runtime

    summary = train_medusa(
        pattern_target,
        tiny_data_file,
        heldout,
        tmp_path / "run",
        steps=20,
        overrides=("validation.served_tau.max_new_tokens=24",),
    )
    served = summary["served_validation"]
    runtime = load_runtime(summary["export"], None, "fp32")
    bench = run_bench(
        runtime, load_prompts(str(heldout), runtime.tokenizer, 4), max_new_tokens=24, skip_hf=True
    )
    assert served["served_tau"] == pytest.approx(bench["tau"], abs=1e-9)
    assert served["acceptance_by_position"] == pytest.approx(bench["acceptance_by_position"])
    again = ServedTauProbe(prompt_set=str(heldout), max_new_tokens=24, dtype="fp32")(
        summary["export"]
    )
    assert again["served_tau"] == pytest.approx(bench["tau"], abs=1e-9)


def test_probe_every_n_skips_methods_it_cannot_serve_and_a_failing_probe_does_not_stop_training(
    tmp_path, tiny_target_dir, tiny_data_file, heldout
):
    calls = []

    class Counting:
        every = 2

        def serves(self, method: str) -> bool:
            return True

        def __call__(self, export_dir):
            calls.append(json.loads((Path(export_dir) / "config.json").read_text())["method"])
            return {"served_tau": 1.5}

    summary = train_medusa(
        tiny_target_dir,
        tiny_data_file,
        heldout,
        tmp_path / "a",
        steps=6,
        probe=Counting(),
        overrides=("run.val_every=2",),
    )
    # passes at steps 2, 4, 6 during fit (every 2nd: step 4) and the final trainer.validate (always)
    assert calls == ["medusa", "medusa"]
    assert summary["served_validation"] == {"served_tau": 1.5, "step": 6}
    assert summary["metrics"]["val/served_tau"] == pytest.approx(1.5)

    class NotServed(Counting):
        def serves(self, method: str) -> bool:
            return False

    calls.clear()
    summary = train_medusa(
        tiny_target_dir, tiny_data_file, heldout, tmp_path / "b", steps=2, probe=NotServed()
    )
    assert calls == [] and "served_validation" not in summary
    assert "validation" not in json.loads((Path(summary["export"]) / "config.json").read_text())

    class Failing(Counting):
        def __call__(self, export_dir):
            raise RuntimeError("no such layer")

    summary = train_medusa(
        tiny_target_dir, tiny_data_file, heldout, tmp_path / "c", steps=2, probe=Failing()
    )
    assert summary["steps"] == 2 and "val/served_tau" not in summary["metrics"]
    assert summary["served_validation"]["served_tau"] is None
    assert "no such layer" in summary["served_validation"]["error"]


def test_probe_config_refuses_bad_values_and_turns_off_with_zero():
    from omegaconf import OmegaConf

    from draftsmith.common.errors import ConfigError
    from draftsmith.evals.served_tau import ServedTauProbe, probe_from_config
    from draftsmith.train import served_probe

    def cfg(**block):
        return OmegaConf.create({"validation": {"served_tau": {"every": 1, **block}}})

    assert (
        probe_from_config(cfg(every=0)) is None and probe_from_config(OmegaConf.create({})) is None
    )
    assert probe_from_config(cfg(prompts=2)).prompts == 2
    for bad, match in (
        ({"every": -1}, "every must be >= 0"),
        ({"prompts": 0}, "prompts must be >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=match):
            served_probe(cfg(**bad))
    probe = ServedTauProbe()
    assert (
        probe.serves("medusa")
        and probe.serves("eagle3")
        and not probe.serves("adaptive_temperature")
    )
    assert not probe.serves("diffusion_adapt")


def test_a_prompt_set_the_probe_cannot_load_is_refused_before_training(tmp_path):
    """``validation.served_tau.prompt_set`` is read when the probe is built, not at the first
    validation pass."""
    from omegaconf import OmegaConf

    from draftsmith.common.errors import ConfigError
    from draftsmith.evals.served_tau import probe_from_config

    def probe(prompt_set: str):
        block = {"every": 1, "prompt_set": prompt_set}
        return probe_from_config(OmegaConf.create({"validation": {"served_tau": block}}))

    with pytest.raises(ConfigError, match=r"validation.served_tau.prompt_set=nosuch: "):
        probe("nosuch")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no prompts|no prompts"):
        probe(str(tmp_path / "empty.jsonl"))
    assert probe("mtbench[40:]").prompt_set == "mtbench[40:]"
