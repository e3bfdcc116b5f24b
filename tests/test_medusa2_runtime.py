"""Serving Medusa-2: the export's LoRA is merged into the target at load, greedy speculative
decoding equals the adapted target's own greedy decoding, the plain target is refused, and the
bench's lossy-target report.
"""

from __future__ import annotations

import pytest
import torch
from head_family_utils import fit_steps, fixed_batch, recipe_cfg

from draftsmith.bench import quality
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import TargetMismatchError
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.drafting.registry import build_proposer
from draftsmith.runtime.serving import load_runtime
from draftsmith.runtime.target.loading import load_decoder

pytestmark = pytest.mark.unit

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def medusa2_export(tiny_target_dir, tiny_tokenizer, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.engine.exporting import export_from_module
    from draftsmith.distill.engine.module import DistillModule
    from draftsmith.recipes import get_recipe

    target = Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )
    cfg = recipe_cfg(
        "medusa2",
        heads={"num_heads": 2, "warmup_steps": 2},
        adapter={"rank": 4, "target_modules": ["q_proj", "v_proj"]},
        inference={"tree_nodes": 4, "top_k": 3},
    )
    objective = get_recipe("medusa2").build(cfg, target)
    fit_steps(objective, target, fixed_batch(target.vocab_size, period=5), 12, lr=3e-2)
    module = DistillModule(objective, target, {"lr": 1e-3}, total_steps=12)
    module.run_info = {"target": target.identity()}
    return (
        export_from_module(
            module, tmp_path_factory.mktemp("m2") / "export", training={"steps": 12}
        ),
        target,
    )


def test_medusa2_serves_the_adapted_target_losslessly_and_refuses_the_plain_one(
    medusa2_export, tiny_target_dir
):
    export, adapted = medusa2_export
    rt = load_runtime(str(export), str(tiny_target_dir), "fp32")
    ids = torch.tensor([5, 9, 13, 40, 7, 21])
    with torch.no_grad():
        want = adapted.model(ids[None]).logits[0]
    got = rt.model.forward(ids, rt.model.allocate_cache(8)).logits
    torch.testing.assert_close(
        got, want, rtol=1e-4, atol=1e-4
    )  # the runtime's target IS the adapted one
    plain = load_decoder(tiny_target_dir)
    assert not torch.allclose(plain.forward(ids, plain.allocate_cache(8)).logits, want, atol=1e-3)
    for prompt in ([5, 9, 13], [40, 41, 2, 7, 7, 30]):
        assert rt.speculative.generate(prompt, 16).tokens == generate_ar(rt.model, prompt, 16)
    with pytest.raises(TargetMismatchError, match="changes its target"):
        build_proposer(export, plain, identity=plain_target(tiny_target_dir).identity())


def plain_target(folder):
    """A plain (un-adapted) training Target of the same folder, for its identity."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return Target(
        AutoModelForCausalLM.from_pretrained(folder),
        AutoTokenizer.from_pretrained(folder),
        str(folder),
    )


def test_lossy_target_report(medusa2_export, tiny_target_dir, monkeypatch):
    export, _ = medusa2_export
    rt = load_runtime(str(export), str(tiny_target_dir), "fp32")
    seqs = [[5, 9, 13, 40, 7, 21, 3, 3, 8, 11], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]]
    monkeypatch.setattr(quality, "held_out_sequences", lambda tokenizer: seqs)
    original = load_decoder(tiny_target_dir)
    prompts = [[5, 9, 13], [40, 41, 2]]
    spec = [rt.speculative.generate(p, 12).tokens for p in prompts]
    orig = [generate_ar(original, p, 12) for p in prompts]
    report = quality.lossy_target_report(rt, original, spec, orig)
    assert report["lossy"] and report["held_out_conversations"] == 2
    assert report["perplexity_original"] == pytest.approx(quality.perplexity(original, seqs))
    assert report["perplexity_adapted"] != pytest.approx(report["perplexity_original"])
    agree = sum(a == b for s, o in zip(spec, orig) for a, b in zip(s, o)) / sum(map(len, spec))
    assert report["greedy_token_agreement_with_original"] == pytest.approx(agree)
