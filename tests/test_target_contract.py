"""The declared target interface: nothing outside ``runtime/target/`` probes a target (no getattr /
hasattr), every member a caller of a ``TargetDecoder`` reads is declared on it, and every kind
(lean, family, HF fallback, a wrapper) answers each declared member consistently."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_hf_fallback import tiny
from test_speculative import tiny_llama

from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.prompt_limits import ContextCapWarning
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import ReportsVerifyReuse, StepContext
from draftsmith.runtime.drafting.chain import ChainProposer, DecoderDrafter
from draftsmith.runtime.serving import load_runtime
from draftsmith.runtime.target.hf import HFModelAdapter
from draftsmith.runtime.target.interface import TargetDecoder, TargetSizes, TargetWrapper
from draftsmith.runtime.target.linear_ops import PackedLinear
from draftsmith.runtime.target.loading import load_decoder
from draftsmith.runtime.target.weights import RemoteCodeRefused, check_custom_code

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CALLERS = ("runtime", "bench", "datagen", "evals", "cli")  # code that is handed a runtime target
# A getattr / hasattr on a target (by the names targets go by), or on a config for a size the target
# declares.
PROBE = re.compile(
    r"\b(?:getattr|hasattr)\(\s*(?:getattr\(\s*)?(?:[\w.]*\.)?(?:model|target|target_model|decoder|"
    r"lean|hf|\w+_model)\s*,"
    r"|\b(?:getattr|hasattr)\(\s*[\w.]*(?:cfg|config)\s*,\s*\"(?:num_layers|num_hidden_layers|"
    r"hidden_size|vocab_size|num_heads|num_attention_heads|num_kv_heads|num_key_value_heads|head_dim|"
    r"max_position_embeddings)\""
)
TARGET_CHAINS = (
    "runtime.model",
    "rt.model",
    "spec.model",
    "runtime.speculative.model",
)  # Runtime / SpeculativeDecoder
# Members a caller may read after narrowing the type with isinstance (the loop's verify model
# reporting its reuse).
NARROWED = set(vars(ReportsVerifyReuse)) - set(vars(object))


def _caller_sources() -> list[Path]:
    found = []
    for folder in CALLERS:
        found += [
            p
            for p in (ROOT / folder).rglob("*.py")
            if "runtime/target" not in p.relative_to(ROOT).as_posix()
        ]
    return found


def test_nothing_outside_runtime_target_probes_a_target():
    found = []
    for path in _caller_sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PROBE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == [], (
        "read the declared members of runtime/target/interface.TargetDecoder instead:\n"
        + "\n".join(found)
    )


def test_the_probe_pattern_catches_what_it_is_for():
    assert PROBE.search('device = getattr(model, "device", "cpu")')
    assert PROBE.search('head = getattr(target_model, "lm_head_logits", None)')
    assert PROBE.search('plan = getattr(self.model, "linear_plan", None)')
    assert PROBE.search(
        'limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)'
    )
    assert PROBE.search(
        'layers = getattr(cfg, "num_layers", getattr(cfg, "num_hidden_layers", None))'
    )
    assert not PROBE.search('step_topk = getattr(self.drafter_step, "topk", None)')
    assert not PROBE.search('getattr(args, "temperature", 0.0)')


def _typed_targets(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameter names of ``func`` annotated with TargetDecoder."""
    args = func.args.args + func.args.kwonlyargs + func.args.posonlyargs
    return {
        a.arg
        for a in args
        if a.annotation is not None and "TargetDecoder" in ast.unparse(a.annotation)
    }


def _self_targets(cls: ast.ClassDef) -> set[str]:
    """``self.X`` chains a class's ``__init__`` binds to a TargetDecoder-typed parameter."""
    chains = set()
    for func in cls.body:
        if isinstance(func, ast.FunctionDef) and func.name == "__init__":
            typed = _typed_targets(func)
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in typed
                ):
                    chains |= {
                        ast.unparse(t) for t in node.targets if ast.unparse(t).startswith("self.")
                    }
    return chains


def _reads(tree: ast.AST, names: set[str]) -> set[tuple[str, int]]:
    return {
        (node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in names
    }


def member_reads(source: str) -> set[tuple[str, int]]:
    """(member, line) of every attribute read on a target: a TargetDecoder-typed parameter, a
    ``self.X`` bound to one, or ``runtime.model`` / ``spec.model``."""
    tree = ast.parse(source)
    found = _reads(tree, set(TARGET_CHAINS))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found |= _reads(node, _typed_targets(node))
        elif isinstance(node, ast.ClassDef):
            found |= _reads(node, _self_targets(node))
    return found


def test_every_member_callers_read_is_declared():
    declared = set(dir(TargetDecoder)) | set(TargetDecoder.__annotations__) | NARROWED
    undeclared, reads = [], 0
    for path in _caller_sources():
        for member, line in member_reads(path.read_text(encoding="utf-8")):
            reads += 1
            if member not in declared or member.startswith("_"):
                undeclared.append(f"{path.relative_to(ROOT)}:{line}: .{member}")
    # the scan sees the callers (the loops, the families, the bench, batched generation)
    assert reads > 50
    assert undeclared == [], (
        "declare these on runtime/target/interface.TargetDecoder:\n" + "\n".join(undeclared)
    )


def test_the_member_scan_sees_typed_parameters_and_bound_attributes():
    source = """
def f(model: TargetDecoder, other):
    return model.sizes, model._ops, other.nothing

class Loop:
    def __init__(self, target: TargetDecoder) -> None:
        self.target = target

    def step(self):
        return self.target.secret, runtime.model.linear_ops
"""
    assert {m for m, _ in member_reads(source)} == {"sizes", "_ops", "secret", "linear_ops"}


def _kinds():
    hf_model, lean = tiny_llama(0, layers=3)
    gpt2 = tiny("gpt2")
    return {
        "lean": lean,
        "hf_llama": HFModelAdapter(hf_model),
        "hf_gpt2": HFModelAdapter(gpt2),
        "wrapper": TargetWrapper(lean),
    }


@pytest.mark.parametrize("kind", ["lean", "hf_llama", "hf_gpt2", "wrapper"])
def test_every_kind_answers_the_declared_members(kind):
    target = _kinds()[kind]
    sizes = target.sizes
    assert isinstance(sizes, TargetSizes) and sizes.num_layers >= 2 and sizes.context_length == 256
    assert (
        target.lm_head_weight.shape
        == (sizes.vocab_size, sizes.hidden_size)
        == target.embed_weight.shape
    )
    assert (
        sizes.num_heads % sizes.num_kv_heads == 0
        and sizes.head_dim * sizes.num_heads == sizes.hidden_size
    )
    hidden = torch.randn(3, sizes.hidden_size)
    torch.testing.assert_close(
        target.lm_head_logits(hidden), F.linear(hidden, target.lm_head_weight), atol=1e-5, rtol=1e-5
    )
    lean_like = kind in ("lean", "wrapper")
    assert target.linear_ops == ("dense" if lean_like else "hf") and target.argmax_head
    assert target.layer_range == lean_like and (target.linear_plan is not None) == lean_like
    assert target.kernel_backend == (
        "torch" if lean_like else "n/a"
    )  # tiny_llama asks for the torch kernels
    assert target.packed_head is None or isinstance(target.packed_head, PackedLinear)
    assert (target.decoder_layers is not None) == lean_like
    assert (target.rows_refusal() is None) == (
        kind == "lean"
    )  # a wrapper is not the plain lean decoder's rows step
    cache = target.allocate_cache(8)
    out = target.forward(torch.tensor([1, 2, 3]), cache, logits_for="last")
    assert out.logits.shape == (1, sizes.vocab_size) and cache.length == 0
    if not lean_like:
        with pytest.raises(NotImplementedError, match="no layer-range forward.*--backend lean"):
            target.embed_tokens(torch.tensor([1]))
        with pytest.raises(NotImplementedError, match="no batched step"):
            target.allocate_rows(2, 8)


def test_a_wrapper_delegates_every_declared_member_it_does_not_override():
    _, lean = tiny_llama(0, layers=2)
    wrapped = TargetWrapper(lean)
    assert wrapped.sizes == lean.sizes and wrapped.lm_head_weight is lean.lm_head_weight
    assert wrapped.layer_weights(0, 1)[0] is lean.layers[0]
    ids = torch.tensor([4, 8, 15])
    torch.testing.assert_close(wrapped.embed_tokens(ids), lean.embed_tokens(ids))
    a, b = (
        wrapped.forward(ids, wrapped.allocate_cache(8)),
        lean.forward(ids, lean.allocate_cache(8)),
    )
    torch.testing.assert_close(a.logits, b.logits)


def test_the_step_context_is_built_with_keywords_only():
    with pytest.raises(TypeError):
        StepContext(
            torch.tensor([1, 2]), 2, torch.zeros(4)
        )  # positional: fields of one type could swap unnoticed
    ctx = StepContext(tokens=torch.tensor([1, 2]), root_token=2, hidden=torch.zeros(4))
    assert ctx.stop_policy is None and ctx.acceptance is None


def test_max_new_tokens_past_the_context_is_capped_in_one_line():
    """10^9 new tokens used to size a 10^9-slot cache (an allocator error); now generation stops at
    the context's end with one warning naming it, in the plain and the speculative loop alike."""
    _, lean = tiny_llama(0, layers=2)  # max_position_embeddings 256
    prompt = list(range(1, 11))
    with pytest.warns(
        ContextCapWarning,
        match=r"max_new_tokens=1000000000 runs past the target's context of 256 "
        r"positions \(max_position_embeddings\)",
    ):
        plain = generate_ar(lean, prompt, 10**9)
    assert len(plain) == 256 - len(prompt)
    spec = SpeculativeDecoder(lean, ChainProposer(DecoderDrafter(lean, 300), depth=3))
    with pytest.warns(ContextCapWarning, match="context of 256 positions"):
        assert spec.generate(prompt, 10**9).tokens == plain
    with pytest.raises(
        ValueError, match="the prompt has 256 tokens but the target's context is 256 positions"
    ):
        generate_ar(lean, [1 + i % 90 for i in range(256)], 4)


def custom_code_folder(tmp_path: Path, model_type: str) -> Path:
    """The tiny Llama's folder whose config names its own model code (``auto_map``) under
    ``model_type``."""
    hf, _ = tiny_llama(0, layers=1)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoModelForCausalLM": "modeling_mine.MyLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_target_with_its_own_code_is_refused_without_the_opt_in(tmp_path):
    folder = custom_code_folder(tmp_path, "my_own_lm")
    for load in (
        lambda: load_decoder(folder),
        lambda: load_decoder(folder, backend="hf"),
        lambda: load_runtime(None, str(folder)),
    ):
        with pytest.raises(RemoteCodeRefused) as err:
            load()
        assert "--trust-remote-code" in str(err.value) and "\n" not in str(err.value)
    # the opt-in lets transformers run it
    assert check_custom_code(folder, trust_remote_code=True) is True


def test_a_known_model_type_loads_with_transformers_own_code_whatever_its_auto_map(tmp_path):
    folder = custom_code_folder(tmp_path, "llama")
    assert check_custom_code(folder) is False
    assert isinstance(load_decoder(folder, backend="hf"), HFModelAdapter)  # no remote code runs
