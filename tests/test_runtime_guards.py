"""What guards the runtime and its exports: target identity checks in every proposer builder,
sampled trees from nuclei smaller than the branching, EAGLE-3 head rows and prompt limits (the
speculators export's target and chain length: test_speculators_export.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from test_speculative_sampling import (
    ALPHA,
    SMALL_V,
    SYNTH,
    bigram_drafter,
    chi2_pvalue,
    first_tokens,
)

from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.eagle import EagleConfig
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.drafters.vocab import vocab_maps
from draftsmith.export.format import TargetMismatchError, write_export
from draftsmith.export.target_check import check_target
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes.eagle import objective as eagle_recipe
from draftsmith.recipes.eagle3 import objective as eagle3_recipe
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.verifiers import target_probs
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.chain import SampledTreeProposer
from draftsmith.runtime.drafting.eagle_adapters import Eagle3DraftModel
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer
from draftsmith.runtime.drafting.registry import build_proposer
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig

pytestmark = pytest.mark.unit

LAYERS = [1, 2, 3]


def lean_from_hf(hf: torch.nn.Module) -> LeanDecoder:
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return LeanDecoder(
        ModelConfig.from_hf_dict(hf.config.to_dict()), weights, kernel_backend="torch"
    ).eval()


@pytest.fixture(scope="module")
def local_target(tiny_target_dir, tiny_tokenizer) -> Target:
    """The tiny target loaded from its folder, so its identity names a loadable path."""
    from transformers import AutoModelForCausalLM

    return Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )


# ---- 3. the mismatch message names the recorded target and the one given -------------------------


def test_check_target_names_the_recorded_and_the_given_target(local_target, tiny_tokenizer):
    config = {
        "method": "medusa",
        "target": {**local_target.identity(), "name_or_path": "smollm2-135m"},
    }
    other = Target(
        build_tiny_llama(len(tiny_tokenizer), seed=5), tiny_tokenizer, "smollm2-135m"
    ).identity()
    with pytest.raises(TargetMismatchError) as err:
        check_target(config, other, given="/data/other-folder")
    msg = str(err.value)
    assert "'smollm2-135m'" in msg and "/data/other-folder" in msg and "fingerprint" in msg
    with pytest.raises(TargetMismatchError) as err:  # without given=: never "for 'X', not 'X'"
        check_target(config, other)
    assert "not 'smollm2-135m'" not in str(err.value) and "fingerprint" in str(err.value)


# ---- 4. every proposer builder checks the target identity ----------------------------------------


@pytest.fixture(scope="module")
def method_exports(local_target, tmp_path_factory):
    """Untrained medusa, eagle and eagle3 exports recorded for ``local_target``."""
    tgt = local_target
    torch.manual_seed(0)
    heads = MedusaHeads(
        MedusaConfig(hidden_size=tgt.hidden_size, vocab_size=tgt.vocab_size, num_heads=2)
    )
    out = {
        "medusa": write_export(
            tmp_path_factory.mktemp("m") / "export",
            heads.trainable_state_dict(),
            {
                "method": "medusa",
                "architecture": heads.architecture(),
                "target": tgt.identity(),
                "inference": {"tree": [[0], [1], [0, 0]], "top_k": 2},
            },
        )
    }
    cfg1 = recipe_config("eagle")
    cfg3 = recipe_config("eagle3", {"drafter": {"target_layers": LAYERS, "draft_vocab_size": 0}})
    ids = torch.randint(0, tgt.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    for name, objective in {
        "eagle": eagle_recipe.build(cfg1, tgt),
        "eagle3": eagle3_recipe.build_objective(cfg3, tgt, [(ids, torch.ones_like(ids))]),
    }.items():
        config = {**objective.export_config(), "target": tgt.identity()}
        out[name] = write_export(
            tmp_path_factory.mktemp(name) / "export", objective.module.state_dict(), config
        )
    return out


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_build_proposer_refuses_a_target_with_another_identity(
    method_exports, local_target, tiny_tokenizer, method
):
    build_proposer(method_exports[method], lean_from_hf(local_target.model))  # its own target: fine
    same_sizes = lean_from_hf(
        build_tiny_llama(len(tiny_tokenizer), seed=9)
    )  # other weights, same shapes
    with pytest.raises(TargetMismatchError, match="lm_head"):
        build_proposer(method_exports[method], same_sizes)


# ---- 5. sampling without replacement from a nucleus smaller than the branching -------------------


def test_sampled_tree_without_replacement_small_nucleus_is_exact():
    # A sharp drafter (nucleus of 1-3 tokens at top_p 0.9) under a flatter target (3-5 tokens).
    temperature, top_p, branching, drafter = 1.0, 0.9, (3, 2), bigram_drafter(1, scale=4.0)
    proposer = SampledTreeProposer(
        drafter, branching, temperature=temperature, top_p=top_p, replacement=False
    )
    verifier = RejectionSamplingVerifier(temperature=temperature, top_p=top_p)
    gen = torch.Generator().manual_seed(3)
    prompt = [4, 6]
    tree = proposer.propose(
        StepContext(tokens=torch.tensor(prompt), root_token=6, hidden=torch.zeros(1), generator=gen)
    )
    nucleus = int((target_probs(drafter(torch.tensor(prompt)), temperature, top_p) > 0).sum())
    # draws what the nucleus holds
    assert nucleus < branching[0] and len(tree.children(0)) == nucleus
    counts = torch.zeros(SMALL_V, SMALL_V, SMALL_V)
    for _ in range(2000):
        t1, t2, t3 = first_tokens(proposer, verifier, prompt, 3, gen)
        counts[t1, t2, t3] += 1
    probs = target_probs(SYNTH.double(), temperature, top_p)  # [a, b, V]
    # [t1, t2, t3]
    exact = probs[prompt[0], prompt[1]][:, None, None] * probs[prompt[1]][:, :, None] * probs
    assert float(counts[exact == 0].sum()) == 0
    assert chi2_pvalue(counts.sum(2), exact.sum(2)) > ALPHA
    assert chi2_pvalue(counts.sum(0), exact.sum(0)) > ALPHA


# ---- 6. EAGLE-3 root step: only the needed rows go through the draft LM head ---------------------


class RowCounter(torch.nn.Module):
    """Wraps a head and records how many rows each call passes through it."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head, self.rows = head, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return self.head(x)


class FullHeadEagle3(Eagle3DraftModel):
    """The previous behaviour: logits on every row, then the last one kept (the reference for greedy
    output)."""

    def step(self, hidden, ids, cache, positions, tree_mask, last_only):
        out, logits, cache = self.drafter.draft_step(
            hidden, ids, cache, positions, tree_mask=tree_mask
        )
        return out, logits[:, -1:] if last_only else logits, cache


@pytest.mark.parametrize("policy", ["chain", "tree"])
def test_eagle3_root_step_runs_the_head_on_needed_rows_only(local_target, policy):
    tgt = local_target
    lean = lean_from_hf(tgt.model)
    torch.manual_seed(0)
    d2t, t2d = vocab_maps(torch.arange(0, lean.config.vocab_size, 2), lean.config.vocab_size)
    drafter = Eagle3Drafter(
        Eagle3Config(
            **EagleConfig.dims_from_hf(tgt.config),
            draft_vocab_size=int(t2d.sum()),
            target_layers=tuple(LAYERS),
        ),
        lean.embed_weight,
        d2t,
        t2d,
    )
    counter = RowCounter(drafter.lm_head)
    drafter.lm_head = counter
    top_k, depth = 3, 2
    new = EagleProposer(
        Eagle3DraftModel(drafter), policy, total_tokens=10, depth=depth, top_k=top_k
    )
    long_prompt = [5, 9, 13, 40, 7, 60, 61, 30, 31]
    res = SpeculativeDecoder(lean, new).generate(
        long_prompt, 1 + 1
    )  # prefill + exactly one drafted step
    per_level = 1 if policy == "chain" else top_k
    assert counter.rows == [1] + [per_level] * depth and res.steps == 1
    ref = EagleProposer(FullHeadEagle3(drafter), policy, total_tokens=10, depth=depth, top_k=top_k)
    for prompt in ([5, 9, 13, 40], long_prompt):  # greedy output and trees unchanged
        got, want = (SpeculativeDecoder(lean, p).generate(prompt, 24) for p in (new, ref))
        assert got.tokens == want.tokens and got.tree_sizes == want.tree_sizes


# ---- 7. prompts longer than the target's context -------------------------------------------------


def test_check_prompt_fits_names_what_the_count_and_the_limit():
    from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits

    check_prompt_fits(8191, 8192, "prompt 0")
    with pytest.raises(ValueError, match=r"conversation 12.*9000 tokens.*8192"):
        check_prompt_fits(9000, 8192, "conversation 12")


def test_regenerate_reports_the_conversation_its_length_and_the_limit(
    tiny_target_dir, tiny_tokenizer, tmp_path
):
    from draftsmith.datagen import regenerate as regen
    from draftsmith.datagen.conversation_replies import render_prompt

    records = [
        {
            "conversations": [
                {"from": "human", "value": "hello world"},
                {"from": "gpt", "value": "x"},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": " ".join(["hello"] * 600)},
                {"from": "gpt", "value": "x"},
            ]
        },
    ]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    logs: list[str] = []
    report = regen.regenerate(
        str(data),
        tmp_path / "o.jsonl",
        target=str(tiny_target_dir),
        max_new_tokens=4,
        dtype="fp32",
        log=logs.append,
    )
    assert report.written == 1 and report.skipped == {"prompt longer than the context": 1}
    length = len(
        render_prompt(
            tiny_tokenizer, [{"role": "user", "content": records[1]["conversations"][0]["value"]}]
        )
    )
    line = next(m for m in logs if "conversation 1" in m)
    assert f"{length} tokens" in line and "512" in line and "skipped" in line
