"""Shared fixtures: tiny in-process Llama targets with a real chat-template tokenizer (never the
hub)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Measured step costs (the bench's cost-aware default) go to a per-session folder, never the user's
# cache.
os.environ.setdefault("DRAFTSMITH_COST_CACHE", tempfile.mkdtemp(prefix="draftsmith-costs-"))

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = (
    "the a of to and in is it you that he was for on are with as I his they be at one have this"
    " from or had by hot word but what some we can out other were all there when up use your how"
    " said an each she which do their time if will way about many then them write would like so"
    " these her long make thing see him two has look more day could go come did number sound no"
    " most people my over know water than call first who may down side been now find hello world"
    " python code answer question please explain why user assistant"
).split()


def build_tiny_tokenizer():
    """A word-level tokenizer with ChatML special tokens and chat template, built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "\n"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(WORDS)) + [".", ",", "?", "!"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    return fast


def build_tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    """A random tiny Llama (hidden 64, 4 layers, GQA) in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=1,
        eos_token_id=3,
        bos_token_id=None,
    )
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


# --------------------------------------------------------------------------------------- test tiers
# Every test file declares its tier once, right after its imports: `pytestmark = pytest.mark.unit`
# (or `integration`, `e2e`; a list when the file has other marks too), or lives in a folder named
# after its tier (tests/e2e/...). `make test-fast` runs `-m unit`, `make test-integration` `-m
# integration`, `make test-e2e` `-m e2e`, and `make test` all three; tests/test_tiers.py fails when
# a file declares no tier or several.
#   unit:        tiny in-process models and configs; each test takes seconds at most.
#   integration: the embedded SmolLM2-135M target (its assets, its conversion, real chat data).
#   e2e: whole runs: `train.py` / `draftsmith` subprocesses, training runs end to end, and the
#   chi-square
#                tests that sample thousands of whole decodes (over 5 s each).
# A test (or class) marked `integration` or `e2e` itself keeps that tier whatever its file's (a unit
# file's subprocess run or slow statistical test is marked `@pytest.mark.e2e` on the function);
# `slow` and `gpu` are orthogonal.
TIER_MARKERS = ("unit", "integration", "e2e")
pytest_plugins = ("pytester",)  # tests/test_tiers.py runs the hooks below on a small suite
DESELECTED: list[
    pytest.Item
] = []  # items `-m` / `-k` left out of this run (tests/test_tiers.py checks them too)


def folder_tier(path: Path) -> str | None:
    """The tier a test file gets from living under a folder named after one (tests/e2e/test_x.py:
    e2e)."""
    found = [part for part in path.parent.parts if part in TIER_MARKERS]
    return found[-1] if found else None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers settled here
def pytest_collection_modifyitems(config, items):
    """Give each item exactly its own tier marker if it (or its class) has one, else its file's
    tier.

    The file's marker (its module ``pytestmark``) is moved from the module onto the items that have
    no tier of their own, so that a unit file's ``@pytest.mark.e2e`` test is e2e only, not unit and
    e2e."""
    modules = {}
    for item in items:
        chain = item.listchain()
        module = item.getparent(pytest.Module)
        # class, function
        below_file = chain[chain.index(module) + 1 :] if module in chain else chain
        own = {
            mark.name
            for node in below_file
            for mark in node.own_markers
            if mark.name in TIER_MARKERS
        }
        file_tiers = (
            {mark.name for mark in module.own_markers if mark.name in TIER_MARKERS}
            if module
            else set()
        )
        if module is not None and len(file_tiers) == 1:
            modules[module.nodeid] = module
        tier = (
            next(iter(file_tiers))
            if len(file_tiers) == 1
            else None
            if file_tiers
            else folder_tier(item.path)
        )
        if not own and tier is not None:
            item.add_marker(tier)
    for module in modules.values():  # its items now carry the tier themselves
        module.own_markers[:] = [
            mark for mark in module.own_markers if mark.name not in TIER_MARKERS
        ]


def pytest_deselected(items):
    DESELECTED.extend(items)


# -------------------------------------------------------------------------------- end of test tiers


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run many times faster on one thread than on two contended ones (subprocesses are
    unaffected)."""
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
    """A 2-head Medusa export (random heads, greedy tree of 6 nodes) for the tiny target, one per
    test module."""
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.engine.exporting import export_from_module
    from draftsmith.distill.target.frozen import Target
    from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
    from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree

    target = Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )
    torch.manual_seed(0)
    heads = MedusaHeads(
        MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=2),
        target.lm_head_weight.float(),
    )
    objective = MedusaObjective(
        heads, 0.8, "dataset", 5, default_tree(2, 6, 4), {"top_k": 4, "verifier": "greedy"}
    )

    class Live:
        drafter, run_info = heads, {"target": target.identity()}

    Live.objective = objective
    return export_from_module(Live, tmp_path_factory.mktemp("medusa") / "export", training={})


@pytest.fixture(scope="module")
def bench_prompts_file(tmp_path_factory) -> Path:
    """Two bench prompts as JSONL: a plain prompt and a two-turn conversation."""
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "hello world what is the answer ?"},
                {"turns": ["please explain the code", "why ?"]},
            ]
        )
        + "\n"
    )
    return path


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    """Deterministic synthetic ShareGPT-style conversations over the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    words = sorted(set(WORDS))

    def sentence(lo: int, hi: int) -> str:
        length = int(torch.randint(lo, hi, (1,), generator=g))
        return (
            " ".join(words[int(i)] for i in torch.randint(0, len(words), (length,), generator=g))
            + " ."
        )

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
    """AdamW steps of ``objective`` on one batch and its target features; the loss after each step's
    forward."""
    opt = torch.optim.AdamW(objective.module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- the fused C++ kernel, once per ISA variant this CPU runs (test_cpu_layer, test_cpu_stack)
def runnable_isas() -> list[str]:
    """The kernel variants this CPU can build and run (an AVX512-BF16 CPU runs the avx2 one as
    well)."""
    from draftsmith.kernels import cpu_layer

    return [isa for isa in cpu_layer.ISAS if cpu_layer.why_unavailable(isa) is None]


@pytest.fixture(scope="module", params=runnable_isas() or [None])
def ext(request):
    """The fused kernel built for one ISA variant (each test using it runs once per runnable
    variant)."""
    from draftsmith.kernels import cpu_layer

    return cpu_layer.load_cpu_layer(request.param)


@pytest.fixture
def use_variant(ext, monkeypatch):
    """Make ``linear_backend="cpp"`` models (which load the default variant) run ``ext`` instead."""
    from draftsmith.kernels import cpu_layer

    monkeypatch.setattr(cpu_layer, "load_cpu_layer", lambda isa=None: ext)
    return ext
