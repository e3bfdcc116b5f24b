"""The oracle proposer (`bench --oracle-acceptance P --oracle-chain K`): greedy output equals plain
greedy decoding at every acceptance and chain, measured tau follows sum_{i=0..K} p^i, bench.json
carries the oracle's row beside (or without) a drafter's, and bad values are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.bench.oracle import OracleRequest, run_oracle
from draftsmith.cli import main
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting import oracle as oracle_module
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.drafting.oracle import OracleProposer, expected_tau
from draftsmith.runtime.target.loading import load_decoder

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 14], [7], [20, 21, 22, 23, 40, 41, 42, 17, 8, 2, 60]]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_decoder(
        tiny_target_dir, dtype=torch.float32, backend="lean", kernel_backend="torch"
    )


def references(target, prompts, new, chain):
    """Plain greedy continuations, ``chain`` tokens past the generation (as the bench decodes
    them)."""
    return {tuple(p): generate_ar(target, p, new + chain) for p in prompts}


def oracle_decode(target, prompts, new, acceptance, chain, seed=0, refs=None, draft_ms=0.0):
    oracle = OracleProposer(
        refs or references(target, prompts, new, chain), acceptance, chain, draft_ms, seed
    )
    spec = SpeculativeDecoder(target, oracle, GreedyVerifier("torch"), kernel_backend="torch")
    return oracle, [spec.generate(p, new) for p in prompts]


@pytest.mark.parametrize("acceptance,chain", [(0.0, 1), (0.5, 3), (0.8, 2), (1.0, 4), (0.3, 5)])
def test_oracle_output_equals_plain_greedy_and_accepts_what_it_drafts_right(
    target, acceptance, chain
):
    new = 40
    oracle, results = oracle_decode(target, PROMPTS, new, acceptance, chain)
    assert isinstance(oracle, Proposer)
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == generate_ar(target, prompt, new)  # exact: the loop stays lossless
        assert max(result.depths) == chain == min(result.depths)  # a full chain every step
    accepted = [a for r in results for a in r.accepted_per_step]
    assert oracle.diverged == 0
    if acceptance == 0.0:
        assert set(accepted) == {0}  # a wrong position is never the greedy token
    if acceptance == 1.0:
        assert all(a == chain for r in results for a in r.accepted_per_step[:-1])


def test_measured_tau_follows_the_expected_tau(target):
    """Statistical (fixed seed): ~160 verify steps at p = 0.7, K = 3 (expected tau 2.53; its
    standard error ~0.09)."""
    prompts = [[5 + i, 9, 14 + 2 * i] for i in range(4)]
    acceptance, chain, new = 0.7, 3, 104
    _, results = oracle_decode(target, prompts, new, acceptance, chain, seed=1)
    accepted = [
        a for r in results for a in r.accepted_per_step[:-1]
    ]  # the last step is cut at the limit
    tau = sum(a + 1 for a in accepted) / len(accepted)
    assert len(accepted) > 140
    assert abs(tau - expected_tau(acceptance, chain)) < 0.3
    assert expected_tau(acceptance, chain) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    once, again = (
        oracle_decode(target, prompts[:1], 24, acceptance, chain, seed=1)[1][0] for _ in range(2)
    )
    assert once.accepted_per_step == again.accepted_per_step  # seeded: runs repeat
    assert once.accepted_per_step == results[0].accepted_per_step[: len(once.accepted_per_step)]


def test_a_wrong_reference_costs_acceptance_never_correctness(target):
    new, chain = 32, 3
    refs = references(target, PROMPTS, new, chain)
    broken = list(refs[tuple(PROMPTS[0])])
    broken[10] = oracle_module.wrong_token(broken[10])  # as if a bf16 near-tie had flipped there
    refs[tuple(PROMPTS[0])] = broken
    oracle, results = oracle_decode(target, PROMPTS, new, 1.0, chain, refs=refs)
    assert [r.tokens for r in results] == [generate_ar(target, p, new) for p in PROMPTS]
    assert oracle.diverged == 1
    with pytest.raises(ValueError, match="no greedy reference"):
        oracle_decode(target, [[1, 2]], 4, 0.5, 2, refs=refs)


def test_the_simulated_draft_cost_is_spent_once_per_draft_call(target, monkeypatch):
    waits = []
    monkeypatch.setattr(oracle_module, "spin_wait", waits.append)
    oracle, results = oracle_decode(target, PROMPTS[:1], 16, 0.5, 2, draft_ms=0.6)
    assert waits == [0.6] * results[0].steps and oracle.draft_calls == results[0].steps


def test_run_oracle_reports_its_row(target):
    row = run_oracle(target, (), PROMPTS, 24, OracleRequest(0.6, 2, 0.0, 1), kernels="torch")
    assert (
        row["acceptance"] == 0.6
        and row["chain"] == 2
        and row["expected_tau"] == pytest.approx(1.96)
    )
    assert row["lossless"] is True and row["diverged_prompts"] == 0 and row["rehearsals"] == 1
    assert (
        row["speedup_vs_ar"] > 0
        and 1.0 <= row["tau"] <= 3.0
        and len(row["acceptance_by_position"]) == 2
    )


def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hello world what is the answer ?"}\n{"prompt": "please explain the code"}\n'
    )
    return path


def test_bench_oracle_alone_writes_its_keys(tiny_target_dir, tmp_path, capsys):
    code = main(
        [
            "bench",
            "--oracle-acceptance",
            "0.8",
            "--oracle-chain",
            "3",
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts_file(tmp_path)),
            "--max-new-tokens",
            "12",
            "--dtype",
            "fp32",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "b" / "bench.json").read_text())
    oracle = result["oracle"]
    assert {"speedup_vs_ar", "tau", "acceptance", "chain", "expected_tau", "lossless"} <= set(
        oracle
    )
    assert (
        oracle["acceptance"] == 0.8
        and oracle["chain"] == 3
        and oracle["expected_tau"] == pytest.approx(2.952)
    )
    assert result["method"] == "oracle" and oracle["lossless"] is True
    assert "| oracle (seed 0) | 3 | 0.80 (measured " in (tmp_path / "b" / "bench.md").read_text()


def test_bench_with_a_drafter_puts_the_oracle_row_next_to_it(medusa_export, tmp_path, capsys):
    code = main(
        [
            "bench",
            "--drafter",
            str(medusa_export),
            "--oracle-acceptance",
            "0.5",
            "--oracle-chain",
            "2",
            "--prompts",
            str(prompts_file(tmp_path)),
            "--max-new-tokens",
            "8",
            "--dtype",
            "fp32",
            "--skip-hf",
            "--lossless-dtype",
            "same",
            "--stop-policy",
            "export",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert (
        result["method"] == "medusa"
        and result["oracle"]["chain"] == 2
        and result["oracle"]["lossless"] is True
    )
    table = (tmp_path / "b" / "bench.md").read_text()
    assert "| medusa (served) |" in table and "| oracle (seed 0) | 2 | 0.50 (measured " in table


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--oracle-acceptance", "1.5"], "must be in [0, 1], got 1.5"),
        (["--oracle-acceptance", "-0.1"], "must be in [0, 1], got -0.1"),
        (["--oracle-acceptance", "nan"], "must be in [0, 1], got nan"),
        (["--oracle-acceptance", "0.5", "--oracle-chain", "0"], "--oracle-chain"),
        (["--oracle-acceptance", "0.5", "--oracle-draft-ms", "-1"], "--oracle-draft-ms"),
        (["--oracle-chain", "3"], "go with --oracle-acceptance"),
        (["--oracle-acceptance", "0.5", "--temperature", "0.7"], "greedy decoding"),
    ],
)
def test_bad_oracle_values_are_refused_in_one_line(flags, message, capsys):
    assert main(["bench", *flags, "--target", "/nonexistent/never-loaded"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
