"""DFlash + Markov/confidence heads exported as DSpark (export/dspark.py): speculators 0.9.0's
``dspark`` type and the DeepSpec-style folder llama.cpp's ``draft-dspark`` converter reads, instead
of dropping the heads.

Sources of the key names: speculators 0.9.0 ``models/dspark/{config,model_definitions,core}.py``
(``MarkovHead``: ``markov_w1`` an ``nn.Embedding`` [V, r], ``markov_w2`` a bias-free ``Linear``
[V_draft, r]; ``ConfidenceHead.proj`` ``Linear(H [+ r], 1)``; config fields ``markov_rank``,
``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``,
``sample_from_anchor``), loaded for real in its venv below (e2e). llama.cpp's converter (the ``make
llamacpp`` tree, when on disk; else skipped with why) is run on our DeepSpec folder: its
``DSparkModel`` maps ``model.markov_head.markov_w{1,2}`` and ``model.confidence_head.proj`` (gguf-py
``tensor_mapping.py``), prefixing ``model.`` itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from dflash_exports import export_dflash
from safetensors.torch import load_file, save_file
from test_speculators_export import HAVE_SPECULATORS, SPECULATORS_PYTHON, _no_speculators_reason

from draftsmith.distill.target.frozen import Target
from draftsmith.export.dflash import dflash_key_names
from draftsmith.export.format import ExportError, read_export
from draftsmith.export.gguf import converter_input, gguf_manifest
from draftsmith.export.speculators import to_speculators

pytestmark = pytest.mark.unit

HEAD_KEYS = (
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",
    "confidence_head.proj.bias",
)


@pytest.fixture()
def target(tiny_tokenizer, tiny_target_dir) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, str(tiny_target_dir))


def reference(drafter, target: Target, n: int = 6) -> dict[str, torch.Tensor]:
    """Our heads on random slots: Markov logit term, confidence logit, and the drafted-token term it
    includes."""
    g = torch.Generator().manual_seed(3)
    h = target.hidden_size
    hidden = torch.randn(n, h, generator=g)  # pre-norm slot states
    prev = torch.randint(0, target.vocab_size, (n,), generator=g)
    drafted = torch.randint(0, target.vocab_size, (n,), generator=g)
    with torch.no_grad():
        normed = drafter.norm(hidden)
        markov = drafter.logits(drafter.head_input(hidden, prev)) - drafter.logits(normed)  # [n, V]
        conf = drafter.confidence_logit(drafter.head_input(hidden, prev), drafted)  # [n]
        token_term = (
            F.embedding(drafted, drafter.embed_weight) @ drafter.confidence_head.weight[0, h:]
        )  # [n]
    return {
        "normed": normed,
        "prev": prev,
        "markov": markov,
        "conf": conf,
        "token_term": token_term,
    }


def test_speculators_dspark_keeps_the_heads_exactly(tmp_path, target, tiny_target_dir):
    export, drafter = export_dflash(target, tmp_path / "export", heads=True)
    out = to_speculators(export, tmp_path / "spec", str(tiny_target_dir))
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["speculators_model_type"], cfg["architectures"]) == ("dspark", ["DSparkSpeculator"])
    assert cfg["speculators_config"]["algorithm"] == "dspark" and cfg["sample_from_anchor"] is False
    assert (cfg["markov_rank"], cfg["markov_head_type"]) == (drafter.config.markov_rank, "vanilla")
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted([*dflash_key_names(2), *HEAD_KEYS])
    v, h, r = target.vocab_size, target.hidden_size, drafter.config.markov_rank
    assert (
        tensors["markov_head.markov_w1.weight"].shape == (v, r)
        and tensors["markov_head.markov_w2.weight"].shape == (v, r)
        and tensors["confidence_head.proj.weight"].shape == (1, h + r)
    )
    ref = reference(drafter, target)
    w1, w2 = tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"]
    torch.testing.assert_close(
        w1[ref["prev"]] @ w2.T, ref["markov"], atol=1e-5, rtol=1e-4
    )  # speculators' bias
    theirs = F.linear(
        torch.cat((ref["normed"], w1[ref["prev"]]), -1),
        tensors["confidence_head.proj.weight"],
        tensors["confidence_head.proj.bias"],
    )[:, 0]
    torch.testing.assert_close(
        theirs + ref["token_term"], ref["conf"], atol=1e-5, rtol=1e-4
    )  # only that term left
    assert cfg["draftsmith"]["confidence_dropped_term_norm"] > 0


def test_without_the_targets_weights_the_heads_are_refused(tmp_path, target):
    export, _ = export_dflash(target, tmp_path / "export", heads=True)
    with pytest.raises(ExportError, match="pass --target with the local folder"):
        to_speculators(export, tmp_path / "spec", "org/model")
    assert not (tmp_path / "spec").exists()


def test_llamacpp_gets_a_deepspec_folder_and_draft_dspark(tmp_path, target, tiny_target_dir):
    export, drafter = export_dflash(target, tmp_path / "export", heads=True)
    config = converter_input(export, tmp_path / "in", tiny_target_dir)
    cfg = json.loads((tmp_path / "in" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["target_layer_ids"] == [
        0,
        1,
        2,
    ]  # z-lab ids
    assert (
        cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]
        and cfg["markov_rank"] == drafter.config.markov_rank
    )
    assert set(HEAD_KEYS) <= set(load_file(tmp_path / "in" / "model.safetensors"))
    manifest = gguf_manifest(
        config, {"draft": "draft.gguf", "target": "t.gguf"}, export, tiny_target_dir
    )
    assert manifest["spec_type"] == "draft-dspark" and "--spec-type draft-dspark" in manifest["run"]
    plain, _ = export_dflash(target, tmp_path / "plain")  # no heads: still the z-lab DFlash layout
    assert (
        gguf_manifest(
            converter_input(plain, tmp_path / "in2", tiny_target_dir),
            {"draft": "d", "target": "t"},
            plain,
            tiny_target_dir,
        )["spec_type"]
        == "draft-dflash"
    )


def _llamacpp_converter() -> tuple[object | None, str]:
    """(the converter root holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` whose
    converter registers our ``Qwen3DSparkModel``, or None, why not)."""
    from draftsmith.bench.llamacpp_build import llamacpp_dir

    root = llamacpp_dir()
    if not (root / "conversion").is_dir() or not (root / "convert_hf_to_gguf.py").is_file():
        return None, f"llama.cpp's converter is not on disk ({root}: run `make llamacpp`)"
    for path in sorted((root / "conversion").glob("*.py")):
        if re.search(r"register\([^)]*\"Qwen3DSparkModel\"", path.read_text(errors="replace")):
            return root, ""
    return (
        None,
        (
            f"the converter in {root / 'conversion'} registers no Qwen3DSparkModel (no draft-dspark"
            " there)"
        ),
    )


CONVERTER, NO_CONVERTER = _llamacpp_converter()


# the embedded SmolLM2 target: llama.cpp's converter knows its tokenizer, not the tiny one's
@pytest.mark.integration
@pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER or "no converter")
def test_llamacpps_own_converter_turns_our_deepspec_folder_into_a_dspark_gguf(tmp_path):
    """The real ``convert_hf_to_gguf.py`` (the ``make llamacpp`` tree) on our DeepSpec folder: every
    head tensor reaches the GGUF under llama.cpp's DSpark names with our values, and the DSpark keys
    are set."""
    import sys
    from pathlib import Path

    from draftsmith import assets
    from draftsmith.export.gguf import run_converter

    folder = Path(assets.resolve_target("smollm2-135m"))
    export, _ = export_dflash(Target.load(str(folder), "fp32"), tmp_path / "export", heads=True)
    converter_input(export, tmp_path / "in", folder)
    out = run_converter(CONVERTER, tmp_path / "in", tmp_path / "draft.gguf", folder)
    sys.path.insert(0, str(CONVERTER / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    reader = GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    assert {
        "markov_w1.weight",
        "markov_w2.weight",
        "conf_proj.weight",
        "conf_proj.bias",
        "fc.weight",
    } <= set(tensors), sorted(tensors)
    ours = load_file(tmp_path / "in" / "model.safetensors")
    w1 = next(t for n, t in tensors.items() if n.startswith("markov_w1"))
    raw = torch.frombuffer(
        bytearray(w1.data.tobytes()),
        dtype={"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[
            w1.tensor_type.name
        ],
    )
    got = raw.float().reshape(ours[HEAD_KEYS[0]].shape)
    torch.testing.assert_close(
        got, ours[HEAD_KEYS[0]].float(), atol=2e-2, rtol=2e-2
    )  # bf16 in the GGUF
    fields = {f.name: f for f in reader.fields.values()}
    conf = next(f for name, f in fields.items() if name.endswith(".has_confidence_head"))
    assert bool(conf.parts[conf.data[0]][0])
    anchor = next(f for name, f in fields.items() if name.endswith("sample_from_anchor"))
    assert not bool(
        anchor.parts[anchor.data[0]][0]
    )  # draftsmith's slot convention (export/dspark.py)
    layers = fields["dflash.target_layers"]
    taps = [int(layers.parts[i][0]) for i in layers.data]
    # HF hidden_states ids, as we tap them
    assert taps == read_export(export)[0]["architecture"]["target_layers"]


SPECULATORS_DSPARK = r"""
import sys, torch
from safetensors.torch import load_file
from speculators import SpeculatorModel

out, ref_path = sys.argv[1:3]
ref = load_file(ref_path)
model = SpeculatorModel.from_pretrained(out).eval()
assert type(model).__name__ == "DSparkDraftModel", type(model)
state = model.state_dict()
ours = load_file(out + "/model.safetensors")
for key, value in ours.items():  # no unknown key: each is one of the model's, with our values
    assert torch.equal(state[key], value), key
# the target's own weights, taken from the verifier
shared = ("embed_tokens.", "lm_head.", "verifier_")
missing = sorted(k for k in state if k not in ours and not k.startswith(shared))
assert not missing, missing
prev = ref["prev"][None]  # [1, n]
with torch.no_grad():
    bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=ref["normed"][None])[0]
    emb = model.markov_head.prev_embeddings(prev)
    conf = model.confidence_head(torch.cat([ref["normed"][None], emb], -1))[0]
assert (bias - ref["markov"]).abs().max() < 1e-4, (bias - ref["markov"]).abs().max()
assert (conf + ref["token_term"] - ref["conf"]).abs().max() < 1e-4
print("DSPARK_OK")
"""


@pytest.mark.e2e  # the real speculators library, in its own venv, in a subprocess
@pytest.mark.skipif(not HAVE_SPECULATORS, reason=_no_speculators_reason())
def test_real_speculators_loads_it_as_dspark_with_our_heads(tmp_path, target, tiny_target_dir):
    export, drafter = export_dflash(target, tmp_path / "export", heads=True)
    out = to_speculators(export, tmp_path / "spec", str(tiny_target_dir))
    ref = {k: v.contiguous() for k, v in reference(drafter, target).items()}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    argv = [
        str(SPECULATORS_PYTHON),
        "-c",
        SPECULATORS_DSPARK,
        str(out),
        str(tmp_path / "ref.safetensors"),
    ]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
    )
    assert proc.returncode == 0 and "DSPARK_OK" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
