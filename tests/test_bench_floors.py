"""`bench --profile` against the bandwidth floors: byte counts from the loaded modules, the
read-bandwidth probe, the ratios and verdicts, and the new keys of a real (tiny) bench run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from draftsmith.bench import floors
from draftsmith.bench.prompts import load_prompts
from draftsmith.bench.report import markdown_table, write_outputs
from draftsmith.bench.run import run_bench
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.serving import load_runtime
from draftsmith.runtime.target.loading import load_decoder

pytestmark = pytest.mark.unit

H, INTER, HEADS, KV, LAYERS = 64, 128, 4, 2, 4  # conftest.build_tiny_llama
HD = H // HEADS


@pytest.fixture(scope="module")
def tiny_decoder(tiny_target_dir):
    return load_decoder(tiny_target_dir, dtype=torch.float32)


def _hand_layer_params() -> int:
    # q, k, v, o, gate, up, down and the two norms of one Llama layer
    return H * H + 2 * KV * HD * H + H * H + 3 * H * INTER + 2 * H


def test_decoder_step_bytes_equal_the_hand_sum_of_the_parameters(tiny_decoder):
    model, ctx = tiny_decoder, 10
    vocab = model.embed_weight.shape[0]
    got = floors.decoder_step_bytes(model, ctx)
    assert got["layers"] == 4 * LAYERS * _hand_layer_params()
    assert got["final_norm"] == 4 * H
    assert got["lm_head"] == 4 * vocab * H  # tied: the embedding, read once as the head
    assert got["embed_rows"] == 4 * H
    assert got["kv_cache"] == 4 * 2 * LAYERS * KV * HD * ctx
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    # a verify forward of 5 tokens reads the same weights and 5 embedding rows
    five = floors.decoder_step_bytes(model, ctx, new_tokens=5)
    assert five["total"] - got["total"] == 4 * 4 * H
    # in bf16 every tensor (and the cache) is half as big
    assert floors.decoder_step_bytes(model.to(torch.bfloat16), ctx)["total"] * 2 == got["total"]
    model.to(torch.float32)


class _Drafter(nn.Module):
    def __init__(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * H, H)  # own weights: 2H*H + H
        self.register_buffer(
            "embed_weight", embed, persistent=False
        )  # the target's: one row per call
        self.register_buffer(
            "lm_head_weight", head, persistent=False
        )  # the target's head, read whole
        self.register_buffer("d2t", torch.arange(7))  # integer map: gathered, not streamed


# a draftsmith-style helper object between the proposer and its module (as EAGLE's serving model)
class _Serving:
    __module__ = "draftsmith.tests_fake"

    def __init__(self, drafter: nn.Module, target: nn.Module) -> None:
        self.drafter, self.target = drafter, target
        self.calls = 0

    def run(self) -> None:
        self.drafter.fc(torch.zeros(1, 2 * H))


class _Proposer(Proposer):
    """An EAGLE-style proposer: it counts its own drafter forwards (the declared
    ``draft_calls``)."""

    __module__ = "draftsmith.tests_fake"
    counts_draft_calls = True

    def __init__(self, model: _Serving) -> None:
        self.model = model

    def _draft(self) -> None:
        self.draft_calls += 1
        self.model.run()


def test_drafter_bytes_count_own_weights_the_shared_head_and_one_embedding_row(tiny_decoder):
    target = tiny_decoder
    vocab = target.embed_weight.shape[0]
    untied_head = torch.randn(vocab, H)
    proposer = _Proposer(_Serving(_Drafter(target.embed_weight, untied_head), target))
    got = floors.drafter_call_bytes(proposer, target)
    # fc + a head the target does not hold
    assert got["drafter_weights"] == 4 * (2 * H * H + H) + 4 * vocab * H
    assert got["target_lm_head"] == 0 and got["embed_rows"] == 4 * H
    # holding the target's own (tied) head: counted as the shared LM head, the target's layers never
    shared = _Proposer(_Serving(_Drafter(target.embed_weight, target.lm_head_weight), target))
    got = floors.drafter_call_bytes(shared, target)
    assert got["drafter_weights"] == 4 * (2 * H * H + H) and got["target_lm_head"] == 4 * vocab * H
    assert got["embed_rows"] == 0  # the tied tensor is also named lm_head_weight: read whole, once
    assert got["total"] == 4 * (2 * H * H + H) + 4 * vocab * H


def test_draft_calls_are_counted_through_draft_or_module_forwards(tiny_decoder):
    proposer = _Proposer(
        _Serving(_Drafter(tiny_decoder.embed_weight, torch.randn(3, H)), tiny_decoder)
    )
    proposer._draft()  # before the block: not counted
    with floors.counting_draft_calls(proposer, tiny_decoder) as counted:
        for _ in range(3):
            proposer._draft()
    assert counted["calls"] == 3 and "_draft" not in vars(
        proposer
    )  # read from the counter: nothing replaced

    class Heads(
        Proposer
    ):  # a proposer that counts nothing itself: one forward of its heads per call
        __module__ = "draftsmith.tests_fake"

        def __init__(self) -> None:
            self.heads = nn.Linear(H, 5)

    heads = Heads()
    with floors.counting_draft_calls(heads, tiny_decoder) as counted:
        heads.heads(torch.zeros(H))
        heads.heads(torch.zeros(H))
    heads.heads(torch.zeros(H))  # after the block: not counted, the hook is removed
    assert counted["calls"] == 2 and not heads.heads._forward_pre_hooks


def test_ratios_and_verdicts_from_a_fake_profile(tiny_decoder):
    target = tiny_decoder
    proposer = _Proposer(_Serving(_Drafter(target.embed_weight, torch.randn(8, H)), target))
    bandwidth = 1.0  # GB/s: 1 ms per MB
    steps = {
        "context_tokens": 20.0,
        "ar_context_tokens": 12.0,
        "tree_nodes": 5.0,
        "draft_calls": 2.0,
    }
    ar_floor = floors.decoder_step_bytes(target, 12)["total"] / 1e6
    call_floor = floors.drafter_call_bytes(proposer, target)["total"] / 1e6
    verify_floor = floors.decoder_step_bytes(target, 20, new_tokens=5)["total"] / 1e6
    profile = {"steps": 7, "draft_ms": 2 * 1.5 * call_floor, "verify_forward_ms": 3 * verify_floor}
    got = floors.step_floors(target, proposer, profile, steps, 1.42 * ar_floor, bandwidth)
    assert got["ar_step"]["floor_ms"] == pytest.approx(ar_floor)
    assert got["ar_step"]["ratio"] == pytest.approx(1.42) and got["ar_step"]["met"] is False
    assert (
        got["verify_forward"]["ratio"] == pytest.approx(3.0)
        and got["verify_forward"]["new_tokens"] == 5
    )
    assert got["draft_per_call"]["measured_ms"] == pytest.approx(1.5 * call_floor)
    assert (
        got["draft_per_call"]["ratio"] == pytest.approx(1.5)
        and got["draft_per_call"]["met"] is True
    )
    # 4 drafted tokens from 2 calls: each token's floor is half a call's
    assert got["draft_per_token"]["floor_ms"] == pytest.approx(call_floor / 2)
    assert got["draft_per_token"]["ratio"] == pytest.approx(1.5)
    assert floors.verdicts(got) == [
        "AR step 1.42x floor (target 1.3x): missed",
        "drafted token 1.50x floor (target 2.0x): met",
    ]
    # nothing drafted (plain decoding served): no per-token figure, and the verdict says so
    none = floors.step_floors(
        target, proposer, profile, {**steps, "tree_nodes": 1.0}, ar_floor, bandwidth
    )
    assert none["draft_per_token"]["ratio"] is None
    assert floors.verdicts(none)[1] == "drafted token: not measured (target 2.0x)"
    assert floors.verdicts(none)[0] == "AR step 1.00x floor (target 1.3x): met"


def test_bandwidth_probe_is_positive_finite_cached_and_uses_the_thread_count(monkeypatch):
    seen = []
    real = floors._reduce_once
    monkeypatch.setattr(
        floors, "_reduce_once", lambda buf: (seen.append(torch.get_num_threads()), real(buf))[1]
    )
    before = torch.get_num_threads()
    gbs = floors.read_bandwidth_gbs(threads=1, mib=8, repeats=2, fresh=True)
    assert math.isfinite(gbs) and gbs > 0
    # probed on 1 thread, then restored
    assert seen and set(seen) == {1} and torch.get_num_threads() == before
    calls = len(seen)
    # cached
    assert floors.read_bandwidth_gbs(threads=1, mib=8, repeats=2) == gbs and len(seen) == calls
    with pytest.raises(ValueError, match="threads, mib and repeats"):
        floors.read_bandwidth_gbs(threads=1, mib=0)


def test_bench_profile_writes_the_floor_keys_and_verdicts(medusa_export, tmp_path):
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "hello world what is the answer ?"}) + "\n")
    rt = load_runtime(str(medusa_export), None, "fp32")
    prompts = load_prompts(str(prompts_file), rt.tokenizer, None)
    result = run_bench(rt, prompts, max_new_tokens=8, skip_hf=True, profile=True)
    found = result["profile"]["floors"]
    assert found["bandwidth_gbs"] > 0 and found["cpu"]
    assert found["draft_calls_source"] == "counted"
    assert found["draft_calls_per_step"] == pytest.approx(
        1.0
    )  # Medusa: one forward of every head per step
    heads = rt.speculative.proposer.heads
    cfg = heads.config
    own = 4 * cfg.num_heads * (cfg.num_layers * (H * H + H) + cfg.head_vocab_size * H)
    assert found["draft_call_bytes"]["drafter_weights"] == own
    for key in ("ar_step", "verify_forward", "draft_per_call", "draft_per_token"):
        assert found[key]["floor_ms"] > 0 and found[key]["ratio"] > 0
    assert [v.split(" ")[0] for v in result["profile"]["verdicts"]] == ["AR", "drafted"]
    table = markdown_table(result)
    assert "vs bandwidth floor" in table and result["profile"]["verdicts"][0] in table
    written = json.loads((write_outputs(result, tmp_path / "out") / "bench.json").read_text())
    assert written["profile"]["floors"]["ar_step"]["target"] == 1.3


def test_step_costs_run_after_the_loops_mean_context(tiny_decoder, monkeypatch):
    """The cost curve is timed after ``context`` cached tokens (the prompt repeated), as the decode
    loop runs at prompt
    + half the new tokens: the prefill the model sees has that length, and the floor counts that
      much KV.
    """
    from types import SimpleNamespace

    from draftsmith.bench import floors
    from draftsmith.bench.step_costs import step_costs

    monkeypatch.setattr(floors, "read_bandwidth_gbs", lambda *a, **k: 10.0)
    seen: list[int] = []
    forward = tiny_decoder.forward

    def recording(ids, cache, **kw):
        seen.append(int(ids.shape[0]))
        return forward(ids, cache, **kw)

    monkeypatch.setattr(tiny_decoder, "forward", recording)
    runtime = SimpleNamespace(model=tiny_decoder, speculative=None)
    short = step_costs(runtime, [5, 6, 7], repeats=1)
    assert seen[0] == 3
    seen.clear()
    long = step_costs(runtime, [5, 6, 7], repeats=1, context=40)
    assert seen[0] == 40
    # 37 more tokens of KV read per step
    assert long["weight_bytes_per_step"] > short["weight_bytes_per_step"]


def test_profile_measures_drafting_even_when_plain_decoding_is_served(medusa_export, tmp_path):
    """The cost-aware default served plain decoding on the best export, and ``--profile`` then
    measured no drafting ("drafted token: not measured"): it now profiles the best measured shape
    (else the export's proposer) and puts plain decoding back."""
    from dataclasses import asdict

    from draftsmith.bench.step_profile import profile_steps
    from draftsmith.runtime.drafting.base import NullProposer
    from draftsmith.runtime.shapes import draft_shapes

    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "hello world what is the answer ?"}) + "\n")
    rt = load_runtime(str(medusa_export), None, "fp32")
    prompts = load_prompts(str(prompts_file), rt.tokenizer, None)
    export_proposer = rt.speculative.proposer
    best = draft_shapes.candidates(export_proposer)[0]
    draft_shapes.apply_shape(rt.speculative, draft_shapes.PLAIN)
    cost_model = {
        "table": [
            {"shape": "plain", "spec": asdict(draft_shapes.PLAIN), "measured_speedup": 1.0},
            {"shape": best.label, "spec": asdict(best), "measured_speedup": 0.9},
        ]
    }
    for model, expect in ((cost_model, best.label), (None, "the export's proposer")):
        report = profile_steps(rt, prompts, 8, export_proposer, model)
        assert (
            report["profiled"].startswith(expect)
            and "plain decoding is served" in report["profiled"]
        )
        assert report["draft_ms"] > 0 and report["floors"]["draft_per_token"]["ratio"] > 0
        assert isinstance(
            rt.speculative.proposer, NullProposer
        )  # plain decoding is still what is served
