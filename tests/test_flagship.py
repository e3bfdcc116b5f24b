"""The flagship drafter (issue 49 item 3): stored in bf16 and served lossless by the runtime in
fp32; replaced only by a candidate whose held-out first-position acceptance gains 0.02 (the
comparison printed either way), atomically; every stage resumable and a damaged file refused in one
line; the sittings of ``make train-best`` warm-start from the drafter with the most tokens; ``make
demo``'s table has one row per bench."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from safetensors import safe_open

from draftsmith.distill.target.frozen import Target
from draftsmith.evals.flagship import FlagshipError, read_shipped, ship, stage
from draftsmith.evals.flagship_record import demo_table
from draftsmith.evals.flagship_train import finished, plan_sitting
from draftsmith.evals.learning_curve import EvalSettings
from draftsmith.export.format import read_export, write_export

pytestmark = pytest.mark.unit
SETTINGS = EvalSettings(
    prompt_sets=("mtbench", "humaneval"), prompts=2, max_new_tokens=8, dtype="fp32"
)


def _quiet(_: str) -> None:
    """Lines the tests do not read."""


def _candidate(source: Path, out: Path, acceptance: float, tokens: int = 1000) -> Path:
    """A copy of ``source`` whose (fake) held-out acceptance is ``acceptance``."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config["training"] = {"tokens": tokens, "steps": 10, "fake_acceptance": acceptance}
    (out / "config.json").write_text(json.dumps(config))
    return out


class FakeEvaluate:
    """Reads the acceptance a candidate's config says; counts its calls; can be made to stop as
    Ctrl-C does."""

    def __init__(self, interrupt: bool = False) -> None:
        self.calls: list[str] = []
        self.interrupt = interrupt

    def __call__(self, export: str, settings, measure=False):
        if self.interrupt:
            raise KeyboardInterrupt
        self.calls.append(export)
        value = json.loads((Path(export) / "config.json").read_text())["training"][
            "fake_acceptance"
        ]
        record = {
            "first_position_acceptance": value,
            "chain_acceptance": [value, value / 2, 0, 0],
            "conditional_acceptance": [value, 0.5, 0, 0],
            "verify_steps": 100,
            "generated_tokens": 16,
        }
        return {name: record for name in settings.prompt_sets}, None


def _ship(candidate: Path, dest: Path, work: Path, evaluate, **kw) -> dict:
    return ship(candidate, dest, work, SETTINGS, evaluate=evaluate, say=_quiet, **kw)


def test_ships_only_a_real_gain_in_bf16_with_its_record(tmp_path, medusa_export):
    dest, work, evaluate = tmp_path / "flagship", tmp_path / "work", FakeEvaluate()
    first = _ship(_candidate(medusa_export, tmp_path / "a", 0.40), dest, work, evaluate)
    assert first["shipped"] and first["shipped_mean"] is None
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    fp32 = (medusa_export / "model.safetensors").stat().st_size
    assert (dest / "model.safetensors").stat().st_size < 0.55 * fp32
    config, _ = read_export(dest)  # the identity still holds: shapes and names are unchanged
    record = json.loads((dest / "RECORD.json").read_text())
    assert record["held_out"]["sets"]["mtbench"]["first_position_acceptance"] == 0.40
    assert record["training"]["tokens"] == 1000 and record["weights"]["stored_dtype"] == "bfloat16"
    assert "Held-out acceptance" in (dest / "README.md").read_text()
    before = (dest / "model.safetensors").read_bytes()

    said: list[str] = []
    small = ship(
        _candidate(medusa_export, tmp_path / "b", 0.41),
        dest,
        work,
        SETTINGS,
        evaluate=evaluate,
        say=said.append,
    )
    assert not small["shipped"] and small["gain"] == pytest.approx(0.01)
    assert (
        dest / "model.safetensors"
    ).read_bytes() == before  # one copy of the weights per real gain
    assert "| mtbench | 0.400 | 0.410 |" in said and any(
        "the flagship stays as it is" in s for s in said
    )
    # the shipped one's evaluation comes from its record
    assert evaluate.calls.count(str(dest)) == 0

    big = _ship(_candidate(medusa_export, tmp_path / "c", 0.43, tokens=5000), dest, work, evaluate)
    assert big["shipped"] and big["gain"] == pytest.approx(0.03)
    record = json.loads((dest / "RECORD.json").read_text())
    assert (
        record["shipped"]["replaced_mean_first_position"] == pytest.approx(0.40)
        and record["training"]["tokens"] == 5000
    )


def test_every_stage_resumes_and_damage_is_refused_in_one_line(tmp_path, medusa_export):
    dest, work = tmp_path / "flagship", tmp_path / "work"
    candidate = _candidate(medusa_export, tmp_path / "a", 0.40)
    with pytest.raises(KeyboardInterrupt):
        _ship(candidate, dest, work, FakeEvaluate(interrupt=True))
    assert not dest.exists()
    staged = next(work.glob("*/staged"))
    stamp = (staged / "model.safetensors").stat().st_mtime_ns
    evaluate = FakeEvaluate()
    assert _ship(candidate, dest, work, evaluate)["shipped"]
    assert (
        staged / "model.safetensors"
    ).stat().st_mtime_ns == stamp  # the kept bf16 copy was reused
    again = FakeEvaluate()
    _ship(candidate, dest, work, again)
    assert again.calls == []  # its evaluation was kept too

    (next(work.glob("*/eval.json"))).write_text("{")  # damaged
    with pytest.raises(FlagshipError, match="eval.json is damaged .*delete it and re-run") as err:
        _ship(candidate, dest, work, FakeEvaluate())
    assert "\n" not in str(err.value)
    broken = _candidate(medusa_export, tmp_path / "broken", 0.5)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(FlagshipError, match="the candidate .*corrupt or truncated"):
        _ship(broken, dest, work, FakeEvaluate())
    (dest / "RECORD.json").write_text('{"method":')
    with pytest.raises(FlagshipError, match="RECORD.json is damaged .*git checkout --"):
        read_shipped(dest)
    with pytest.raises(
        FlagshipError, match="neither a run folder with export/ nor an export folder"
    ):
        _ship(tmp_path / "nothing", dest, work, FakeEvaluate())


def test_the_cli_refuses_a_damaged_candidate_in_one_line(tmp_path, medusa_export, capsys):
    from draftsmith.cli import main

    broken = _candidate(medusa_export, tmp_path / "broken", 0.5)
    (broken / "model.safetensors").write_bytes(b"\x00" * 10)
    code = main(
        [
            "flagship",
            "ship",
            str(broken),
            "--dest",
            str(tmp_path / "dest"),
            "--work",
            str(tmp_path / "w"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and len(err) == 1
        and err[0].startswith("draftsmith flagship: error: the candidate ")
    )


def test_a_candidate_of_another_method_or_target_is_refused(
    tmp_path, medusa_export, tiny_tokenizer
):
    dest, work = tmp_path / "flagship", tmp_path / "work"
    _ship(_candidate(medusa_export, tmp_path / "a", 0.40), dest, work, FakeEvaluate())
    other = _candidate(medusa_export, tmp_path / "other", 0.9)
    config = json.loads((other / "config.json").read_text())
    config["target"]["fingerprint"] = "sha256:another-tokenizer"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlagshipError, match="trained for another target .*fingerprint"):
        _ship(other, dest, work, FakeEvaluate())


def _eagle3_export(out: Path, tiny_tokenizer) -> tuple[Path, Target, list[list[int]], dict]:
    """An EAGLE-3 drafter trained briefly on a tiny target's own greedy outputs (so it accepts),
    fp32 export."""
    from test_eagle_runtime import (
        LAYERS,
        NEW,
        PROMPTS,
        greedy_batch,
        lean_from_hf,
        plain_greedy,
        train,
    )

    from draftsmith.recipes.eagle3 import objective as eagle3_recipe

    hf = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)
    tgt, lean = Target(hf, tiny_tokenizer, "tiny"), lean_from_hf(hf)
    reference = {tuple(p): plain_greedy(lean, p, NEW) for p in PROMPTS}
    batch = greedy_batch(reference)
    torch.manual_seed(0)
    cfg = recipe_config(
        "eagle3", {"drafter": {"target_layers": list(LAYERS), "draft_vocab_size": 64}}
    )
    objective = eagle3_recipe.build_objective(cfg, tgt, [(batch["input_ids"], batch["loss_mask"])])
    train(objective, tgt, batch)
    config = {**objective.export_config(), "target": tgt.identity(), "training": {"steps": 60}}
    return write_export(out, objective.module.state_dict(), config), lean, PROMPTS, reference


def test_a_bf16_stored_eagle3_export_is_served_lossless_in_fp32(tmp_path, tiny_tokenizer):
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.drafting.registry import build_proposer

    export, lean, prompts, reference = _eagle3_export(tmp_path / "fp32", tiny_tokenizer)
    config, weights = read_export(export)
    staged = stage(config, weights, None, tmp_path / "bf16")
    taus = {}
    for name, folder in (("fp32", export), ("bf16", staged)):
        decoder = SpeculativeDecoder(lean, build_proposer(folder, lean, policy="tree"))
        taus[name] = []
        for prompt in prompts:
            result = decoder.generate(prompt, len(reference[tuple(prompt)]))
            assert result.tokens == reference[tuple(prompt)], (
                name,
                prompt,
            )  # lossless, whatever the drafter
            taus[name].append(result.tau)
    assert min(taus["bf16"]) > 2.0, taus  # the bf16-stored drafter still drafts what it learned
    assert sum(taus["bf16"]) == pytest.approx(sum(taus["fp32"]), rel=0.15)
    for name, value in (
        build_proposer(staged, lean, policy="tree").model.drafter.state_dict().items()
    ):
        assert value.dtype in (
            torch.float32,
            torch.long,
            torch.int64,
            torch.bool,
        ), name  # served in fp32


def test_sittings_resume_an_unfinished_run_then_warm_start_from_the_most_tokens(
    tmp_path, medusa_export
):
    flagship = _candidate(medusa_export, tmp_path / "flagship", 0.4, tokens=1000)
    root = tmp_path / "root"
    overrides = ["recipe=medusa", "trainer.max_steps=10"]
    run, argv = plan_sitting(root, overrides, flagship, "auto", _quiet)
    assert run == root / "runs" / "001" and f"run.init_from={flagship.resolve()}" in argv
    assert f"hydra.run.dir={run}" in argv and (root / "current").resolve() == run.resolve()
    assert not finished(run)
    again, argv2 = plan_sitting(
        root, overrides, flagship, "auto", _quiet
    )  # killed before its export: resumed
    assert again == run and argv2 == argv
    _candidate(medusa_export, run / "export", 0.45, tokens=4000)
    config = json.loads((run / "export" / "config.json").read_text())
    config["training"]["steps"] = 10
    (run / "export" / "config.json").write_text(json.dumps(config))
    assert finished(run)
    second, argv = plan_sitting(
        root, overrides, flagship, "auto", _quiet
    )  # the local run has more tokens
    assert second == root / "runs" / "002" and f"run.init_from={(run / 'export').resolve()}" in argv
    third, argv = plan_sitting(tmp_path / "fresh", overrides, None, "none", _quiet)
    assert not any(a.startswith("run.init_from=") for a in argv)
    with pytest.raises(ValueError, match="pass trainer.max_steps=N"):
        plan_sitting(tmp_path / "x", ["recipe=medusa"], flagship, "auto", _quiet)


def test_the_demo_table_has_one_row_per_bench(tmp_path):
    for name, tau in (("medusa", 1.3), ("flagship", 1.8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(
            json.dumps(
                {
                    "method": name,
                    "tau": tau,
                    "tokens_per_s": {"runtime_ar": 10.0, "speculative": 10.0 * tau / 1.2},
                    "speedup": {"vs_runtime_ar": tau / 1.2, "vs_runtime_ar_ci95": [1.0, 1.6]},
                    "lossless": True,
                }
            )
        )
    table = demo_table(
        [str(tmp_path / "medusa"), str(tmp_path / "flagship"), str(tmp_path / "none")]
    )
    rows = [line for line in table.splitlines() if line.startswith("| /")]
    assert len(rows) == 3 and "| flagship | 1.80 |" in rows[1] and "1.50x [1.00, 1.60]" in rows[1]
    assert "not benched" in rows[2]
