"""DFlash runtime: greedy speculative output == plain greedy (random and trained exports, confidence
cut on and off), the incremental context cache, the rejection-sampling path, target identity and
option refusals, the shape choice, and `train.py recipe=dflash` end to end into an export the
runtime serves. That sampling preserves the target's distribution: tests/test_dflash_sampling.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from test_eagle_runtime import lean_from_hf, plain_greedy

from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.dflash import DFlashDrafter
from draftsmith.drafters.dflash_config import DFlashConfig
from draftsmith.export.format import TargetMismatchError, read_config, write_export
from draftsmith.recipes.dflash.build import build_objective
from draftsmith.runtime.acceptance.choice import choose_stop_policy
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.stop_policies import FixedDepth
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.dflash import DFlashProposer
from draftsmith.runtime.drafting.registry import build_proposer, chain_options
from draftsmith.runtime.shapes import draft_shapes

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 13, 40], [7, 60, 61], [30, 31, 32, 33, 34, 35, 100, 101, 8]]
NEW = 40
MASK = 1  # <pad>: the greedy continuations below never contain it (checked)


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    hf = build_tiny_llama(len(tiny_tokenizer))
    return Target(hf, tiny_tokenizer, "tiny"), lean_from_hf(hf)


@pytest.fixture(scope="module")
def reference(target):
    return {tuple(p): plain_greedy(target[1], p, NEW) for p in PROMPTS}


def greedy_batch(reference) -> dict[str, torch.Tensor]:
    seqs = [p + reference[tuple(p)] for p in PROMPTS]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [2] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()}


def write(objective, tgt: Target, out: Path) -> Path:
    config = {**objective.export_config(), "target": tgt.identity(), "training": {"steps": 0}}
    return write_export(out, objective.module.state_dict(), config)


@pytest.fixture(scope="module")
def exports(target, reference, tmp_path_factory):
    """A random DFlash export and one trained on the target's greedy continuations (confidence +
    Markov heads)."""
    tgt, _ = target
    batch = greedy_batch(reference)
    assert MASK not in batch["input_ids"].tolist()
    out = {}
    for name, extra in (
        ("random", {}),
        (
            "trained",
            {"confidence_head": True, "markov_head": True, "markov_rank": 8, "anchors_per_seq": 24},
        ),
    ):
        cfg = recipe_config(
            "dflash",
            {
                "drafter": {
                    "target_layers": [1, 2, 3],
                    "block_size": 5,
                    "mask_token_id": MASK,
                    **extra,
                }
            },
        )
        torch.manual_seed(0)
        objective = build_objective(cfg, tgt, [(batch["input_ids"], batch["loss_mask"])])
        if name == "trained":
            feats = tgt.features(batch["input_ids"], batch["attention_mask"], objective.taps)
            opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
            for _ in range(80):
                loss, _ = objective.loss(batch, feats)
                opt.zero_grad()
                loss.backward()
                opt.step()
            objective.module.eval()
        out[name] = write(objective, tgt, tmp_path_factory.mktemp(name) / "export")
    return out


@pytest.mark.parametrize(
    ("name", "options"),
    [("random", {}), ("trained", {}), ("trained", {"cut": 0.5}), ("trained", {"depth": 2})],
)
def test_greedy_speculative_equals_plain_greedy(target, reference, exports, name, options):
    proposer = build_proposer(exports[name], target[1], **options)
    assert proposer.max_tree_nodes == options.get("depth", 4) + 1 and proposer.feature_taps == (
        1,
        2,
        3,
    )
    dec = SpeculativeDecoder(target[1], proposer)
    taus = []
    for prompt in PROMPTS:
        res = dec.generate(prompt, NEW)
        assert res.tokens == reference[tuple(prompt)], (name, options, prompt)
        taus.append(res.tau)
    # memorised continuations: accepted only if serving feeds what training saw
    if name == "trained" and not options:
        assert min(taus) > 2.0, taus


def test_confidence_cut_shortens_blocks(target, exports):
    prompt = PROMPTS[2]
    full = SpeculativeDecoder(target[1], build_proposer(exports["trained"], target[1])).generate(
        prompt, NEW
    )
    cut = SpeculativeDecoder(
        target[1], build_proposer(exports["trained"], target[1], cut=0.999)
    ).generate(prompt, NEW)
    assert full.tokens == cut.tokens
    assert max(cut.tree_sizes) <= max(full.tree_sizes) and sum(cut.tree_sizes) / len(
        cut.tree_sizes
    ) < sum(full.tree_sizes) / len(full.tree_sizes)


def test_learned_stop_policy_reads_the_confidence_head(target, reference, exports):
    """`--stop-policy learned:H` on a DFlash export binds its confidence head (a rejection head);
    lossless, and a strict threshold drafts shorter chains. An export without the head is refused
    naming the option.
    """
    prompt = PROMPTS[2]
    config = read_config(exports["trained"])
    loose, _ = choose_stop_policy("learned:0.99", config, exports["trained"])
    strict, source = choose_stop_policy("learned:0.01", config, exports["trained"])
    assert source == {"spec": "learned:0.01", "source": "flag"}
    runs = [
        SpeculativeDecoder(
            target[1], build_proposer(exports["trained"], target[1]), stop_policy=policy
        ).generate(prompt, NEW)
        for policy in (loose, strict)
    ]
    assert all(run.tokens == reference[tuple(prompt)] for run in runs)
    mean = [sum(run.tree_sizes) / len(run.tree_sizes) for run in runs]
    assert mean[1] < mean[0], mean
    with pytest.raises(ValueError, match="drafter.confidence_head=true"):
        choose_stop_policy("learned:0.5", read_config(exports["random"]), exports["random"])


def test_incremental_context_equals_a_full_recompute(target, exports):
    lean = target[1]
    proposer = build_proposer(exports["trained"], lean)
    prompt = PROMPTS[1]
    res = SpeculativeDecoder(lean, proposer).generate(prompt, 30)
    seq = torch.tensor(prompt + res.tokens)
    n = min(
        proposer.ctx_len, seq.numel()
    )  # the last step's accepted tokens may run past max_new_tokens
    assert len(prompt) < n and res.steps > 1
    out = lean.forward(seq, lean.allocate_cache(seq.numel()), taps=proposer.feature_taps)
    with torch.no_grad():
        full = proposer.drafter.context(
            out.tap_features(proposer.feature_taps)[:n][None], torch.arange(n)[None]
        )
    for (k, v), (fk, fv) in zip(proposer.ctx, full):
        torch.testing.assert_close(k[:, :, :n], fk, atol=1e-4, rtol=0)
        torch.testing.assert_close(v[:, :, :n], fv, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_rejection_sampling_path_runs(target, exports, temperature):
    proposer = build_proposer(exports["trained"], target[1], temperature=temperature)
    dec = SpeculativeDecoder(target[1], proposer, RejectionSamplingVerifier(temperature=0.9))
    res = dec.generate(PROMPTS[0], 20, generator=torch.Generator().manual_seed(0))
    assert len(res.tokens) == 20 and res.lossless and res.steps < 20


def test_refusals_target_identity_and_options(target, exports, tiny_tokenizer):
    tgt, lean = target
    other = Target(build_tiny_llama(len(tiny_tokenizer), seed=1), tiny_tokenizer, "tiny")
    with pytest.raises(TargetMismatchError, match="fingerprint"):
        build_proposer(exports["random"], lean, identity=other.identity())
    shallow = lean_from_hf(build_tiny_llama(len(tiny_tokenizer), num_hidden_layers=3))
    with pytest.raises(TargetMismatchError, match="num_hidden_layers: export has 4, target has 3"):
        build_proposer(exports["random"], shallow)
    with pytest.raises(
        ValueError, match=r"depth must be an integer in 1..4 \(block_size - 1\), got 5"
    ):
        build_proposer(exports["random"], lean, depth=5)
    with pytest.raises(ValueError, match="needs a confidence head"):
        build_proposer(exports["random"], lean, cut=0.5)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['policy'\]"):
        build_proposer(exports["random"], lean, policy="tree")
    with pytest.raises(ValueError, match="top_k sizes a tree"):
        build_proposer(exports["random"], lean, top_k=2)
    assert chain_options(exports["random"], 3) == {"depth": 3}


def test_shape_choice_covers_chains_up_to_the_block_and_top_k_trees(target):
    lean = target[1]
    arch = DFlashConfig(
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=lean.config.vocab_size,
        target_hidden_size=64,
        block_size=8,
        mask_token_id=MASK,
        target_layers=(1, 2),
    )
    proposer = DFlashProposer(DFlashDrafter(arch, lean.embed_weight, lean.lm_head_weight))
    found = draft_shapes.candidates(proposer)
    assert [s.depth for s in found if s.kind == "chain"] == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
    ]  # past MAX_CHAIN = 4
    assert any(s.kind == "tree" for s in found)
    reference = plain_greedy(lean, PROMPTS[0], 12)
    for shape in (draft_shapes.Shape.chain(6), draft_shapes.Shape("tree", 3, 8, 2)):
        spec = SpeculativeDecoder(lean, proposer)
        draft_shapes.apply_shape(spec, shape, proposer)
        assert (
            isinstance(spec.stop_policy, FixedDepth) and spec.stop_policy.max_depth == shape.depth
        )
        res = spec.generate(PROMPTS[0], 12)
        assert res.tokens == reference and max(res.depths) <= shape.depth
        assert max(res.tree_sizes) == shape.nodes, shape  # a chain of 7 nodes, a tree of 8
    calib = draft_shapes.calibration_proposer(proposer)  # the superset tree of every candidate
    assert SpeculativeDecoder(lean, calib).generate(PROMPTS[1], 12).tokens == plain_greedy(
        lean, PROMPTS[1], 12
    )


def test_tree_option_from_the_builder(target, exports):
    proposer = build_proposer(
        exports["trained"], target[1], tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]], top_k=2
    )
    assert proposer.tree is not None and proposer.max_tree_nodes == 6
    dec = SpeculativeDecoder(target[1], proposer)
    for prompt in PROMPTS:
        assert dec.generate(prompt, 20).tokens == plain_greedy(target[1], prompt, 20)
    with pytest.raises(
        ValueError, match="a tree 5 deep needs 5 draft slots; this DFlash block has 4"
    ):
        build_proposer(
            exports["trained"],
            target[1],
            tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]],
        )


@pytest.mark.e2e  # a train.py subprocess
def test_train_py_end_to_end_export_is_served_losslessly(tmp_path, tiny_target_dir, tiny_data_file):
    run_dir = tmp_path / "run"
    code = (
        "import sys, runpy; import draftsmith.recipes.dflash; sys.argv = ['train.py'] +"
        f" sys.argv[1:]; runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')"
    )
    overrides = [
        "recipe=dflash",
        f"target.name_or_path={tiny_target_dir}",
        "target.dtype=fp32",
        f"data.spec={tiny_data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=2",
        "run.checkpoint_every=2",
        "run.final_eval_batches=1",
        "drafter.target_layers=[1,2,3]",
        "drafter.block_size=4",
        "drafter.confidence_head=true",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", code, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "DRAFTSMITH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    lean = lean_from_hf(hf)
    proposer = build_proposer(run_dir / "export", lean)
    assert proposer.drafter.config.block_size == 4 and proposer.drafter.confidence_head is not None
    dec = SpeculativeDecoder(lean, proposer)
    for prompt in PROMPTS[:2]:
        assert dec.generate(prompt, 16).tokens == plain_greedy(lean, prompt, 16)
