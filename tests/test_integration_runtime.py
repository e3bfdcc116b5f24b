"""Integration tier for the runtime on the embedded SmolLM2-135M target (fp32 for exactness)."""

from __future__ import annotations

import pytest
import torch

from draftsmith import assets
from draftsmith.bench.prompts import load_prompts
from draftsmith.bench.timing import compare_outputs, time_hf_generate
from draftsmith.export.format import write_export
from draftsmith.export.identity import target_identity
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes.medusa.objective import default_tree
from draftsmith.runtime.serving import load_runtime

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def medusa_export(tmp_path_factory):
    """Untrained Medusa heads for the embedded target: acceptance is low but exercises every
    path."""
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.runtime.target.weights import load_lm_head

    folder = assets.default_target_dir()
    lm_head = load_lm_head(folder)
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=576, vocab_size=49152, num_heads=3), lm_head)
    for head in heads.heads:  # perturb so that heads disagree with the target head
        head.blocks[0].linear.weight.data.normal_(0, 0.02)
    identity = target_identity(
        "smollm2-135m",
        AutoConfig.from_pretrained(folder),
        AutoTokenizer.from_pretrained(folder),
        lm_head,
    )
    config = {
        "method": "medusa",
        "architecture": heads.architecture(),
        "target": identity,
        "inference": {"tree": default_tree(3, 12, 10), "top_k": 10, "verifier": "greedy"},
    }
    return write_export(
        tmp_path_factory.mktemp("medusa") / "export", heads.trainable_state_dict(), config
    )


def test_greedy_speculative_equals_hf_generate_on_mtbench_in_fp32(medusa_export):
    torch.set_num_threads(2)
    runtime = load_runtime(str(medusa_export), None, "fp32")
    prompts = load_prompts("mtbench", runtime.tokenizer, 4)
    hf = time_hf_generate(runtime.folder, prompts, 40, dtype=torch.float32)
    spec = [runtime.speculative.generate(p, 40, eos_ids=runtime.eos_ids) for p in prompts]
    verdict = compare_outputs(hf["outputs"], [r.tokens for r in spec])
    assert verdict["all_identical"], verdict
    assert sum(r.steps for r in spec) < sum(len(r.tokens) for r in spec), (
        "no draft token was ever accepted"
    )
