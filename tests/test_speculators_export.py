"""speculators-format converter: our side always (files, keys, shapes, config; the verifier a
bare export defaults to and aliases resolved to their folder; ``speculative_tokens`` equal to the
runtime's chain) and the real library (separate venv) when it is installed.

The library check runs in ``.cache/venv-speculators`` (made by ``make test``; speculators 0.9.0 pins
its own transformers), in a subprocess: ``SpeculatorModel.from_pretrained`` must load the converted
folder with identical weights, and its own EAGLE-3 forward (eager attention, teacher-forced TTT)
must reproduce our per-step logits.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from safetensors.torch import load_file, save_file
from test_eagle_runtime import lean_from_hf

from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import ExportError, read_config
from draftsmith.export.speculators import to_speculators
from draftsmith.recipes.eagle import objective as eagle_recipe
from draftsmith.recipes.eagle3 import objective as eagle3_recipe
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.registry import build_proposer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# made by `make speculators-venv` (part of `make test`)
SPEC_VENV = ROOT / ".cache" / "venv-speculators"
SPECULATORS_PYTHON = Path(
    os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON", SPEC_VENV / "bin" / "python")
)


def _no_speculators_reason() -> str:
    failed = SPEC_VENV.with_name(SPEC_VENV.name + ".failed")
    if failed.is_file():
        return f"speculators==0.9.0 could not be installed: {failed.read_text().strip()[-400:]}"
    return f"speculators venv not found at {SPECULATORS_PYTHON} (run `make speculators-venv`)"


HAVE_SPECULATORS = (
    SPECULATORS_PYTHON.is_file()
    and (SPEC_VENV / ".done").is_file()
    or "DRAFTSMITH_SPECULATORS_PYTHON" in os.environ
)
LAYERS = [1, 2, 3]
STEPS = 3

CHECK_SCRIPT = r"""
import sys, torch
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig

out, ref_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
ref = load_file(ref_path)
model = SpeculatorModel.from_pretrained(out)
assert type(model).__name__ == "Eagle3DraftModel", type(model)
ours = load_file(out + "/model.safetensors")
state = model.state_dict()
for key, value in ours.items():
    assert torch.equal(state[key], value), key
assert torch.equal(state["embed_tokens.weight"], ref["embed"])
aux_ids = model.config.eagle_aux_hidden_state_layer_ids
assert aux_ids == [1, 2, 3], aux_ids
print("WEIGHTS_OK", len(ours))

config = SpeculatorModelConfig.from_pretrained(out)
config.transformer_layer_config._attn_implementation = "eager"
model = SpeculatorModel.from_pretrained(out, config=config).eval()
captured = []
model.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
ids = ref["input_ids"]
with torch.no_grad():
    model(hidden_states=ref["hidden_states"], input_ids=ids, document_ids=torch.zeros_like(ids),
          ttt_steps=steps)
got = torch.stack(captured)  # [steps, 1, T, Nd]
err = (got - ref["logits"]).abs().max().item()
assert err < 1e-4, err
print("FORWARD_OK", err)
"""


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


@pytest.fixture(scope="module")
def local_target(tiny_target_dir, tiny_tokenizer) -> Target:
    """The tiny target loaded from its folder, so its identity names a loadable path."""
    from transformers import AutoModelForCausalLM

    return Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )


def export_eagle3(target: Target, out: Path, draft_vocab: int = 48) -> tuple[Path, object]:
    torch.manual_seed(0)
    cfg = recipe_config(
        "eagle3", {"drafter": {"target_layers": LAYERS, "draft_vocab_size": draft_vocab}}
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randint(0, target.vocab_size, (2, 30), generator=g),
            torch.ones(2, 30, dtype=torch.long),
        )
    ]
    objective = eagle3_recipe.build_objective(cfg, target, batches)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.1)
    module = SimpleNamespace(
        drafter=objective.module, objective=objective, run_info={"target": target.identity()}
    )
    return export_from_module(module, out, training={}), objective.module


def speculators_shapes(h: int, v: int) -> dict[str, tuple[int, ...]]:
    """The tensors (name: shape) of a speculators EAGLE-3 checkpoint for our one-layer drafter of
    hidden size ``h`` over a ``v``-token vocabulary: 48 draft tokens, 4 heads and 2 KV heads of 16,
    MLP 128, the embedding included."""
    return {
        "fc.weight": (h, 3 * h),
        "norm.weight": (h,),
        "lm_head.weight": (48, h),
        "d2t": (48,),
        "t2d": (v,),
        "layers.0.input_layernorm.weight": (h,),
        "layers.0.hidden_norm.weight": (h,),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (4 * 16, 2 * h),
        "layers.0.self_attn.k_proj.weight": (2 * 16, 2 * h),
        "layers.0.self_attn.v_proj.weight": (2 * 16, 2 * h),
        "layers.0.self_attn.o_proj.weight": (h, 4 * 16),
        "layers.0.mlp.gate_proj.weight": (128, h),
        "layers.0.mlp.up_proj.weight": (128, h),
        "layers.0.mlp.down_proj.weight": (h, 128),
        "embed_tokens.weight": (v, h),
    }


def test_our_side_files_keys_shapes_and_config(tmp_path, target):
    export, drafter = export_eagle3(target, tmp_path / "export")
    verifier = tmp_path / "verifier"
    target.model.save_pretrained(verifier)
    out = to_speculators(export, tmp_path / "spec", str(verifier))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    h, v = target.hidden_size, target.vocab_size
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 48
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    # inference.depth + 1: the longest path the runtime drafts (aligned, issue 9)
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {
        "name_or_path": str(verifier),
        "architectures": ["LlamaForCausalLM"],
    }
    layer = config["transformer_layer_config"]
    assert (
        layer["model_type"],
        layer["num_hidden_layers"],
        layer["vocab_size"],
        layer["hidden_size"],
    ) == ("llama", 1, v, h)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (
        4,
        2,
        16,
    )
    assert (
        config["eagle_aux_hidden_state_layer_ids"] == LAYERS and config["target_hidden_size"] == h
    )
    assert not any(
        config[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    )
    tensors = load_file(out / "model.safetensors")
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    assert shapes == speculators_shapes(h, v)
    assert torch.equal(
        tensors["layers.0.self_attn.q_proj.weight"], drafter.layer.self_attn.q_proj.weight
    )
    assert torch.equal(tensors["d2t"], drafter.d2t) and torch.equal(tensors["t2d"], drafter.t2d)
    assert torch.equal(
        tensors["embed_tokens.weight"], target.embed_weight
    )  # read from the local verifier
    # Full draft vocabulary: no maps (speculators then has none); bf16 conversion on request.
    export_full, _ = export_eagle3(target, tmp_path / "export_full", draft_vocab=0)
    full = load_file(
        to_speculators(export_full, tmp_path / "spec_full", "org/model", dtype="bfloat16")
        / "model.safetensors"
    )
    assert "d2t" not in full and full["fc.weight"].dtype == torch.bfloat16
    assert "embed_tokens.weight" not in full  # a hub id: nothing local to copy the embedding from


def test_eagle1_and_other_methods_are_refused_with_a_reason(tmp_path, target):
    cfg = recipe_config("eagle")
    objective = eagle_recipe.build(cfg, target)
    module = SimpleNamespace(
        drafter=objective.module, objective=objective, run_info={"target": target.identity()}
    )
    export = export_from_module(module, tmp_path / "e1", training={})
    with pytest.raises(ExportError, match="no model type for EAGLE-1"):
        to_speculators(export, tmp_path / "out", "org/model")
    assert not (tmp_path / "out").exists()


# the real speculators library, in its own venv (make speculators-venv), in a subprocess
@pytest.mark.e2e
@pytest.mark.skipif(not HAVE_SPECULATORS, reason=_no_speculators_reason())
def test_real_speculators_library_loads_it_with_identical_weights_and_logits(tmp_path, target):
    export, drafter = export_eagle3(target, tmp_path / "export")
    verifier = tmp_path / "verifier"
    target.model.save_pretrained(verifier)
    out = to_speculators(export, tmp_path / "spec", str(verifier))
    g = torch.Generator().manual_seed(7)
    T = 10
    hidden = torch.randn(1, T, 3 * target.hidden_size, generator=g)
    ids = torch.randint(0, target.vocab_size, (1, T), generator=g)
    # speculators' teacher forcing: step j reads input_ids shifted left by j (zero padded).
    tokens = [torch.cat((ids[:, j:], ids.new_zeros(1, j)), 1) for j in range(STEPS)]
    with torch.no_grad():
        logits = torch.stack(
            [drafter.logits(a) for a in drafter.ttt_forward(hidden, tokens)]
        )  # [S, 1, T, Nd]
    ref = tmp_path / "ref.safetensors"
    save_file(
        {
            "hidden_states": hidden,
            "input_ids": ids,
            "logits": logits,
            "embed": target.embed_weight.detach().clone(),
        },
        str(ref),
    )
    proc = subprocess.run(
        [str(SPECULATORS_PYTHON), "-c", CHECK_SCRIPT, str(out), str(ref), str(STEPS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "WEIGHTS_OK" in proc.stdout and "FORWARD_OK" in proc.stdout, proc.stdout


def test_speculators_export_defaults_to_recorded_target_and_resolves_aliases(
    local_target, tiny_target_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    from draftsmith import assets
    from draftsmith.cli import main

    export, _ = export_eagle3(local_target, tmp_path / "export")
    assert (
        main(["export", str(export), "--format", "speculators", "--out", str(tmp_path / "a")]) == 0
    )
    verifier = json.loads((tmp_path / "a" / "config.json").read_text())["speculators_config"][
        "verifier"
    ]
    assert verifier["name_or_path"] == str(Path(tiny_target_dir).resolve())
    # An alias (given, or recorded in the export) lands as the folder it resolves to, never as the
    # alias.
    real = assets.resolve_target
    monkeypatch.setattr(
        assets,
        "resolve_target",
        lambda name: str(tiny_target_dir) if name == "smollm2-135m" else real(name),
    )
    assert (
        main(
            [
                "export",
                str(export),
                "--format",
                "speculators",
                "--out",
                str(tmp_path / "b"),
                "--target",
                "smollm2-135m",
            ]
        )
        == 0
    )
    verifier = json.loads((tmp_path / "b" / "config.json").read_text())["speculators_config"][
        "verifier"
    ]
    assert verifier["name_or_path"] == str(Path(tiny_target_dir).resolve())
    aliased = Target(local_target.model, tiny_tokenizer, "smollm2-135m")
    export2, _ = export_eagle3(aliased, tmp_path / "export_alias")
    assert (
        main(["export", str(export2), "--format", "speculators", "--out", str(tmp_path / "c")]) == 0
    )
    verifier = json.loads((tmp_path / "c" / "config.json").read_text())["speculators_config"][
        "verifier"
    ]
    assert verifier["name_or_path"] == str(Path(tiny_target_dir).resolve())


def test_speculators_speculative_tokens_equal_the_runtime_chain_length(local_target, tmp_path):
    export, _ = export_eagle3(local_target, tmp_path / "export")
    depth = int(read_config(export)["inference"]["depth"])
    out = to_speculators(export, tmp_path / "spec", str(local_target.name_or_path))
    spec = json.loads((out / "config.json").read_text())["speculators_config"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    lean = lean_from_hf(local_target.model)
    proposer = build_proposer(export, lean, policy="chain")
    prompt = torch.tensor([5, 9, 13, 40])
    cache = lean.allocate_cache(8)
    res = lean.forward(prompt, cache, taps=proposer.feature_taps)
    root = int(res.logits[-1].argmax())
    context = torch.cat([prompt, torch.tensor([root])])
    proposer.begin(
        StepContext(
            tokens=context,
            root_token=root,
            hidden=res.hidden,
            taps=res.tap_features(proposer.feature_taps),
        )
    )
    tree = proposer.propose(StepContext(tokens=context, root_token=root, hidden=res.hidden[-1]))
    assert tokens == tree.num_nodes - 1 == depth + 1  # drafted tokens per step, root excluded
