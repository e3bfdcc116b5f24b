"""Shared fixtures: tiny in-process Llama targets with a real chat-template tokenizer (never the hub)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Measured step costs (the bench's cost-aware default) go to a per-session folder, never the user's cache.
os.environ.setdefault("DRAFTSMITH_COST_CACHE", tempfile.mkdtemp(prefix="draftsmith-costs-"))

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from or had by "
         "hot word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him two "
         "has look more day could go come did number sound no most people my over know water than call first who "
         "may down side been now find hello world python code answer question please explain why "
         "user assistant").split()


def build_tiny_tokenizer():
    """A word-level tokenizer with ChatML special tokens and chat template, built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "\n"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(WORDS)) + [".", ",", "?", "!"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.WhitespaceSplit()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast


def build_tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    """A random tiny Llama (hidden 64, 4 layers, GQA) in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
               tie_word_embeddings=True, pad_token_id=1, eos_token_id=3, bos_token_id=None)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


# ----------------------------------------------------------------------------------------------------- test tiers
# Every test file has one tier; `make test-fast` runs `-m unit`, `make test-integration` `-m integration`, `make
# test-e2e` `-m e2e`, and `make test` all three. tests/test_tiers.py fails when a file is missing here.
#   unit:        tiny in-process models and configs; each test takes seconds at most.
#   integration: the embedded SmolLM2-135M target (its assets, its conversion, real chat data).
#   e2e:         whole runs: `train.py` / `draftsmith` subprocesses, training runs end to end, and the chi-square
#                tests that sample thousands of whole decodes (over 5 s each).
# A test marked `integration` or `e2e` itself keeps that tier whatever its file's (a unit file's subprocess run or slow
# statistical test is marked `@pytest.mark.e2e` on the function); `slow` and `gpu` are orthogonal and stay as they are.
TIERS = {
    "test_assets.py": "unit",  # its embedded-package tests are marked integration
    "test_backend_choice.py": "unit",  # its simulated-AVX2 `draftsmith generate` run is marked e2e
    "test_bench.py": "unit",  # its `draftsmith generate` / `bench` CLI run is marked e2e
    "test_bench_floors.py": "unit",
    "test_calibrated_tree.py": "unit",
    "test_chat_encoding.py": "unit",
    "test_clover.py": "unit",
    "test_cli_bad_inputs.py": "unit",
    "test_cli_table.py": "unit",  # its `draftsmith train` run is marked e2e
    "test_clover_runtime.py": "unit",
    "test_cluster_elastic.py": "e2e",
    "test_cluster_memory.py": "unit",
    "test_cluster_preempt.py": "e2e",
    "test_cluster_shard.py": "unit",
    "test_cluster_slurm.py": "e2e",
    "test_cluster_wandb.py": "unit",
    "test_cost_model.py": "unit",
    "test_cost_refit.py": "unit",
    "test_shape_choice.py": "unit",
    "test_cpu_layer.py": "unit",
    "test_cpu_stack.py": "unit",
    "test_cpu_attention_split.py": "unit",
    "test_cpu_tree_sum.py": "unit",
    "test_contention.py": "unit",
    "test_docs.py": "unit",
    "test_thread_governor.py": "unit",
    "test_data.py": "unit",  # its real SmolLM2 template tests are marked integration
    "test_diffusion_adapt.py": "unit",
    "test_dflash.py": "unit",
    "test_dflash_runtime.py": "unit",  # its train.py run is marked e2e
    "test_diffusion_decode.py": "unit",
    "test_diffusion_learn2pd.py": "unit",
    "test_diffusion_mask.py": "unit",
    "test_diffusion_remote.py": "unit",
    "test_draft_attention.py": "unit",
    "test_eagle.py": "unit",  # its train.py run is marked e2e
    "test_eagle3.py": "unit",  # its train.py run is marked e2e
    "test_eagle_native.py": "unit",
    "test_eagle_runtime.py": "unit",
    "test_eagle_sampling.py": "unit",  # its slow test(s) are marked e2e
    "test_dflash_engines.py": "unit",  # real speculators library: e2e; llama.cpp conversion + engine-check: integration
    "test_dflash_export.py": "unit",
    "test_engine_layouts.py": "unit",
    "test_export_v2.py": "unit",
    "test_exportable.py": "unit",
    "test_feature_cache.py": "unit",
    "test_gpu.py": "e2e",  # CUDA only (skipped elsewhere); ends with a train.py run on the GPU
    "test_gpu_check_script.py": "e2e",
    "test_gguf_export.py": "unit",  # its real llama.cpp conversion + engine-check on the embedded target is integration
    "test_head_family_train.py": "e2e",
    "test_hf_fallback.py": "unit",
    "test_house_rules.py": "unit",
    "test_hydra.py": "unit",
    "test_hydra_runtime.py": "unit",
    "test_inference_choice.py": "unit",
    "test_integration_medusa.py": "integration",
    "test_integration_runtime.py": "integration",
    "test_kangaroo.py": "unit",  # its slow test(s) are marked e2e
    "test_kernels.py": "unit",
    "test_model_families.py": "unit",
    "test_layer_range.py": "unit",
    "test_linear_cross_entropy.py": "unit",
    "test_llamacpp.py": "unit",  # its run of the real cached llama.cpp build is marked integration
    "test_long_outputs.py": "unit",
    "test_loop_overheads.py": "unit",
    "test_engine_parity.py": "unit",  # its real llama.cpp parity run on the embedded target is marked integration
    "test_lpo_controller.py": "unit",
    "test_lpo_loss.py": "unit",
    "test_lpo_rollouts.py": "unit",  # its slow test(s) are marked e2e
    "test_medusa.py": "unit",
    "test_medusa2.py": "unit",
    "test_medusa2_runtime.py": "unit",
    "test_medusa_draft_vocab.py": "unit",
    "test_method_table.py": "unit",
    "test_metrics.py": "unit",
    "test_objective_seams.py": "unit",
    "test_regenerate.py": "unit",
    "test_batched_regenerate.py": "unit",
    "test_reward_eval.py": "unit",
    "test_room_walk.py": "e2e",
    "test_rooms.py": "unit",
    "test_runtime_guards.py": "unit",
    "test_runtime_model.py": "unit",
    "test_seams_runtime.py": "unit",
    "test_served_tau.py": "unit",  # its train.py run is marked e2e
    "test_medusa_trained_floor.py": "unit",  # its slow test(s) are marked e2e
    "test_specdecpp.py": "unit",
    "test_specdecpp_stop_rule.py": "unit",
    "test_speculative.py": "unit",
    "test_speculative_sampling.py": "unit",  # its slow test(s) are marked e2e
    "test_speculators_export.py": "unit",  # its run of the real speculators library is marked e2e
    "test_strategies.py": "unit",  # its `train.py --cfg job` runs are marked e2e
    "test_tiers.py": "unit",
    "test_train.py": "e2e",
    "test_train_errors.py": "unit",  # its train.py run is marked e2e
    "test_training_guards.py": "unit",  # its train.py run is marked e2e
    "test_training_refusals.py": "unit",  # its train.py run is marked e2e
    "test_training_scores_nothing.py": "unit",
    "test_tree_verify.py": "unit",
    "test_verify_floor.py": "unit",
}
TIER_MARKERS = ("unit", "integration", "e2e")
pytest_plugins = ("pytester",)  # tests/test_tiers.py runs the hooks below on a small suite
DESELECTED: list[pytest.Item] = []  # items `-m` / `-k` left out of this run (tests/test_tiers.py checks them too)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers added here
def pytest_collection_modifyitems(config, items):
    """Mark each item with its file's tier unless the test already carries a tier marker of its own."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIER_MARKERS) and item.path.name in TIERS:
            item.add_marker(TIERS[item.path.name])


def pytest_deselected(items):
    DESELECTED.extend(items)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run many times faster on one thread than on two contended ones (subprocesses are unaffected)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny Llama + tokenizer folder usable as ``target.name_or_path``."""
    path = tmp_path_factory.mktemp("tiny_target")
    build_tiny_llama(len(tiny_tokenizer)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def medusa_export(tmp_path_factory, tiny_target_dir, tiny_tokenizer) -> Path:
    """A 2-head Medusa export (random heads, greedy tree of 6 nodes) for the tiny target, one per test module."""
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.exporting import export_from_module
    from draftsmith.distill.target import Target
    from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
    from draftsmith.recipes.medusa import MedusaObjective, default_tree

    target = Target(AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir))
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=2),
                        target.lm_head_weight.float())
    objective = MedusaObjective(heads, 0.8, "dataset", 5, default_tree(2, 6, 4), {"top_k": 4, "verifier": "greedy"})

    class Live:
        drafter, run_info = heads, {"target": target.identity()}

    Live.objective = objective
    return export_from_module(Live, tmp_path_factory.mktemp("medusa") / "export", training={})


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    """Deterministic synthetic ShareGPT-style conversations over the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    words = sorted(set(WORDS))

    def sentence(lo: int, hi: int) -> str:
        length = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (length,), generator=g)) + " ."

    # Assistant replies repeat a pattern so that heads have something learnable.
    out = []
    for _ in range(n):
        q = sentence(4, 10)
        a = " ".join([q.split()[0], "is", "the", "answer", "to", "the", "question", "."] * 2)
        out.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    return out


@pytest.fixture(scope="session")
def tiny_data_file(tmp_path_factory) -> Path:
    """A jsonl of 64 synthetic conversations."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in make_conversations(64)) + "\n")
    return path


def train_on_fixed_batch(objective, batch, feats, steps: int = 15, lr: float = 3e-3) -> list[float]:
    """AdamW steps of ``objective`` on one batch and its target features; the loss after each step's forward."""
    opt = torch.optim.AdamW(objective.module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- the fused C++ kernel, once per ISA variant this CPU runs (test_cpu_layer.py, test_cpu_stack.py) --------------
def runnable_isas() -> list[str]:
    """The kernel variants this CPU can build and run (an AVX512-BF16 CPU runs the avx2 one as well)."""
    from draftsmith.kernels import cpu_layer

    return [isa for isa in cpu_layer.ISAS if cpu_layer.why_unavailable(isa) is None]


@pytest.fixture(scope="module", params=runnable_isas() or [None])
def ext(request):
    """The fused kernel built for one ISA variant (each test using it runs once per runnable variant)."""
    from draftsmith.kernels import cpu_layer

    return cpu_layer.load_cpu_layer(request.param)


@pytest.fixture
def use_variant(ext, monkeypatch):
    """Make ``linear_backend="cpp"`` models (which load the default variant) run ``ext`` instead."""
    from draftsmith.kernels import cpu_layer

    monkeypatch.setattr(cpu_layer, "load_cpu_layer", lambda isa=None: ext)
    return ext
