"""`draftsmith bench` / `generate` on a tiny target: the JSON contract, the lossless verdict (also
when plain decoding is served), clear errors. The CLI as a subprocess: tests/test_bench_cli.py; the
timing: tests/test_bench_timing.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith.bench.prompts import load_prompts
from draftsmith.bench.report import write_outputs
from draftsmith.bench.run import run_bench
from draftsmith.common.chat import encode_chat
from draftsmith.export.format import ExportError, TargetMismatchError
from draftsmith.runtime.serving import load_runtime

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def medusa_bench(medusa_export, bench_prompts_file):
    """The tiny Medusa export's runtime (fp32) and its bench over two prompts, 24 new tokens."""
    rt = load_runtime(str(medusa_export), None, "fp32")
    prompts = load_prompts(str(bench_prompts_file), rt.tokenizer, None)
    return rt, run_bench(rt, prompts, max_new_tokens=24)


def test_bench_reports_the_contract_and_is_lossless(medusa_bench):
    rt, result = medusa_bench
    for key in (
        "method",
        "prompts",
        "max_new_tokens",
        "dtype",
        "tau",
        "acceptance_by_position",
        "tokens_per_s",
        "speedup",
        "lossless",
    ):
        assert key in result
    assert result["method"] == "medusa" and result["prompts"] == 2 and result["dtype"] == "float32"
    assert set(result["tokens_per_s"]) == {"hf_generate", "runtime_ar", "speculative"}
    assert set(result["speedup"]) >= {"vs_hf_generate", "vs_runtime_ar"}
    assert result["lossless"] is True and result["runtime_ar_matches_hf"] is True
    oracle = result["lossless_detail"][
        "oracle"
    ]  # beside the drafter: accepted drafts verified on most steps
    assert result["lossless_oracle"] is True and oracle["total"] == 2 and oracle["chain"] == 4
    assert oracle["tau"] > 2.0 and oracle["acceptance"] == 0.8
    assert result["tau"] >= 1.0 and len(result["acceptance_by_position"]) == 2
    assert len(result["head_agreement_top1"]) == 2
    by_size = result["step_costs"]["forward_ms_by_new_tokens"]
    assert list(by_size) == list(range(1, 17)) and all(
        ms > 0 for ms in by_size.values()
    )  # every verify size


def test_bench_writes_json_markdown_and_a_plot(medusa_bench, tmp_path):
    rt, result = medusa_bench
    out = write_outputs(result, tmp_path / "bench")
    assert json.loads((out / "bench.json").read_text())["lossless"] is True
    assert "oracle (acceptance 0.8, chain 4): True (2/2)" in (out / "bench.md").read_text()
    assert (out / "acceptance.png").stat().st_size > 1000 and "tau" in (
        out / "bench.md"
    ).read_text()
    assert (
        "forward ms for " + "/".join(map(str, range(1, 17))) + " new tokens"
        in (out / "bench.md").read_text()
    )
    backend = json.loads((out / "bench.json").read_text())["backend"]  # which backends ran, and why
    assert (
        backend["linear_backend"] == rt.model.linear_ops
        and backend["linear_reason"]
        and backend["cpu"]
    )
    # run_bench's default: HF in same dtype
    assert backend["dtype"] == "float32" and result["hf_dtype"] == "float32"
    inference = json.loads((out / "bench.json").read_text())[
        "inference"
    ]  # what ran and where it came from
    assert inference["verifier"] == {"name": "greedy", "source": "export"}
    assert inference["stop_policy"] == {
        "spec": "none",
        "source": "default",
    }  # this export names none
    assert inference["proposer_options"]["tree"]["source"] == "export"
    assert "greedy (export)" in (out / "bench.md").read_text()
    costs = result["step_costs"]
    assert (
        costs["bandwidth_floor_ms"] > 0
        and costs["ar_step_over_floor"] > 0
        and costs["read_bandwidth_gbs"] > 0
    )
    assert (
        "vs bandwidth floor" in (out / "bench.md").read_text()
        and "why these linears" in (out / "bench.md").read_text()
    )


def test_bench_refuses_an_export_for_another_target(medusa_export, tmp_path, tiny_tokenizer):
    other = tmp_path / "other"
    build_tiny_llama(len(tiny_tokenizer), seed=7).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    with pytest.raises(TargetMismatchError, match="fingerprint"):
        load_runtime(str(medusa_export), str(other), "fp32")


def test_bench_errors_for_bad_inputs(medusa_export, tmp_path, tiny_target_dir):
    with pytest.raises(ExportError, match="does not exist"):
        load_runtime(str(tmp_path / "nope"), None, "fp32")
    rt = load_runtime(str(medusa_export), None, "fp32")
    with pytest.raises(ValueError, match="empty prompt"):
        encode_chat(rt.tokenizer, "   ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompts(str(bad), rt.tokenizer, None)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_runtime(str(medusa_export), None, "int3")
    with pytest.raises(ValueError, match="unknown kernel backend|valid"):
        load_runtime(str(medusa_export), None, "fp32", kernels="cuda-magic")
    with pytest.raises(ValueError, match="linear_backend must be one of auto, dense, mkldnn, cpp"):
        load_runtime(str(medusa_export), None, "bf16", linear_backend="fast")
    long_prompt = list(range(5, 100)) * 60
    with pytest.raises(
        ValueError, match="cache|context is 512 positions"
    ):  # the cache is sized from the target
        rt.speculative.generate(long_prompt, 8)


def test_proposer_options_override_export_defaults(medusa_export):
    from draftsmith.runtime.serving import parse_options

    assert parse_options(["depth=2", "policy=chain", "tree=[[0],[0,0]]"]) == {
        "depth": 2,
        "policy": "chain",
        "tree": [[0], [0, 0]],
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_options(["depth"])
    rt = load_runtime(str(medusa_export), None, "fp32", proposer_options={"tree": [[0], [0, 0]]})
    assert rt.speculative.proposer.max_tree_nodes == 3


def test_an_exception_without_a_message_is_named_not_printed_empty(monkeypatch, capsys):
    """A bug that raises a bare StopIteration used to print `error: ` and nothing else; it is a bug:
    its traceback and a line saying so (tests/test_cli_errors.py has the whole policy)."""
    from draftsmith import cli
    from draftsmith.cli import serving as runtime_cli

    def broken(args):
        raise StopIteration

    monkeypatch.setitem(runtime_cli.HANDLERS, "generate", broken)
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    assert cli.main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert (
        "Traceback" in err and "internal error (StopIteration): this is a bug in draftsmith" in err
    )


def test_bench_table_shows_the_speedup_interval_and_says_when_plain_decoding_was_served(
    medusa_export, bench_prompts_file
):
    from draftsmith.bench.report import markdown_table
    from draftsmith.runtime.drafting.base import NullProposer

    rt = load_runtime(str(medusa_export), None, "fp32")
    # what the cost-aware default serves when speculation would lose
    rt.speculative.proposer = NullProposer()
    result = run_bench(
        rt,
        load_prompts(str(bench_prompts_file), rt.tokenizer, None),
        max_new_tokens=8,
        skip_hf=True,
    )
    lo, hi = result["speedup"]["vs_runtime_ar_ci95"]
    assert lo <= hi and result["served_plain"] is True and result["lossless"] is True
    row = next(
        line
        for line in markdown_table(result).splitlines()
        if line.startswith("| speedup vs runtime AR")
    )
    assert "95% CI" in row and "runtime AR loop itself" in row
    rt.speculative.temperature_policy = lambda hidden: torch.zeros(
        hidden.shape[0]
    )  # still no drafter, but the
    # speculative loop runs (a controller's tempered sampling)
    assert not rt.speculative.serves_plain_ar()


def test_when_plain_decoding_is_served_the_lossless_check_still_runs_the_drafter(
    medusa_export, bench_prompts_file, monkeypatch
):
    """Issue 40: the cost-aware default served plain decoding and "lossless 6/6" compared the plain
    loop with HF, so it said nothing about the export; the table showed the export's stop policy and
    tau 1.000. The check now runs the drafter (the best measured shape, else the export's proposer)
    and both bench.json and the table say what was served and what was checked."""
    from draftsmith.bench import run as bench_run
    from draftsmith.bench.report import markdown_table
    from draftsmith.runtime.shapes import draft_shapes

    def serve_plain(
        runtime, prompts, costs
    ):  # what the cost-aware choice does when speculation would lose
        draft_shapes.apply_shape(runtime.speculative, draft_shapes.PLAIN)
        why = "plain decoding measured fastest (speculation loses here)"
        return {"why": why, "summary": why, "table": [], "shape_label": "plain"}

    monkeypatch.setattr(bench_run, "_apply_cost_aware_depth", serve_plain)
    rt = load_runtime(str(medusa_export), None, "fp32")
    result = run_bench(
        rt,
        load_prompts(str(bench_prompts_file), rt.tokenizer, None),
        max_new_tokens=8,
        skip_hf=True,
        cost_aware=True,
    )
    assert result["served_plain"] is True and result["served"].startswith(
        "plain decoding, no drafter (plain"
    )
    detail = result["lossless_detail"]
    assert detail["checked"] == "the export's proposer (plain decoding is served)"
    assert detail["tau"] is not None and detail["tau"] >= 1.0  # the drafter drafted in the check
    assert result["lossless"] is True and detail["total"] == 2
    table = markdown_table(result)
    assert "| served (what the timed speculative rows ran) | plain decoding, no drafter" in table
    assert (
        "| tau (mean accepted length, incl. bonus) | n/a: plain decoding was served (nothing"
        " drafted); the drafter's tau in the lossless check:" in table
    )
    assert "checked: the export's proposer (plain decoding is served), tau " in table
