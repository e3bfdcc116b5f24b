"""Run DFlash exports inside the engines: the real speculators library (e2e) and llama.cpp
(integration).

Sources and commits: tests/test_dflash_export.py's docstring (the key-list and id checks live
there). Here:

* speculators 0.9.0 (``.cache/venv-speculators``, ``make speculators-venv``), in a subprocess:
  ``SpeculatorModel.from_pretrained`` loads our ``--format speculators`` folder as
  ``DFlashDraftModel`` with identical weights and ``aux_hidden_state_layer_ids``; speculators' own
  z-lab converter (``convert/dflash/converter.py``) turns our ``--format dflash-zlab`` folder into
  the same ids, mask token, block size and weights; its decoder layers (z-lab's
  ``Qwen3DFlashDecoderLayer``) reproduce our drafter's block logits.
* llama.cpp (the cached ``make llamacpp`` build): a random-weight DFlash drafter for the embedded
  SmolLM2 target goes through llama.cpp's own converter; the GGUF holds the tensors
  ``src/models/dflash.cpp`` requires and ``dflash.target_layers`` = our taps (llama.cpp captures
  those target layers' inputs); ``llama-speculative-simple --spec-type draft-dflash`` then produces
  llama.cpp's own plain greedy text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dflash_exports import export_dflash
from safetensors.torch import save_file
from test_speculators_export import HAVE_SPECULATORS, SPECULATORS_PYTHON, _no_speculators_reason

from draftsmith.cli import main
from draftsmith.distill.target.frozen import Target
from draftsmith.export.dflash import to_zlab
from draftsmith.export.speculators import to_speculators

pytestmark = pytest.mark.unit

# ---- the real speculators library (its own venv, a subprocess) -----------------------------------
SPECULATORS_SCRIPT = r"""
import sys, torch
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators.convert.dflash.converter import DFlashConverter

spec, zlab, verifier, ref_path, conv_out = sys.argv[1:6]
ref = load_file(ref_path)
ours = load_file(spec + "/model.safetensors")
model = SpeculatorModel.from_pretrained(spec).eval()
assert type(model).__name__ == "DFlashDraftModel", type(model)
state = model.state_dict()
for key, value in ours.items():
    assert torch.equal(state[key], value), key
assert model.config.aux_hidden_state_layer_ids == [1, 2, 3], model.config.aux_hidden_state_layer_ids
print("WEIGHTS_OK", len(ours))

DFlashConverter().convert(zlab, conv_out, base_model=verifier, validate=False)
converted = SpeculatorModel.from_pretrained(conv_out)
assert converted.config.aux_hidden_state_layer_ids == model.config.aux_hidden_state_layer_ids
assert converted.config.mask_token_id == model.config.mask_token_id
assert converted.config.block_size == 4
for key, value in ours.items():
    assert torch.equal(converted.state_dict()[key].float(), value.float()), key
print("CONVERTER_OK")

taps, block = ref["taps"], ref["block"]
c, b = taps.shape[1], block.shape[1]
with torch.no_grad():
    ctx = model.hidden_norm(model.fc(taps))
    x = torch.nn.functional.embedding(block, ref["embed"])
    pos = torch.arange(c + b).unsqueeze(0)
    rope = model.rotary_emb(x, pos)
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "eager"
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos,
                  position_embeddings=rope)
    logits = model.norm(x)[:, 1:] @ ref["lm_head"].T
err = (logits - ref["logits"]).abs().max().item()
assert err < 1e-4, err
print("FORWARD_OK", err)
"""


# the real speculators library, in its own venv (make speculators-venv), in a subprocess
@pytest.mark.e2e
@pytest.mark.skipif(not HAVE_SPECULATORS, reason=_no_speculators_reason())
def test_real_speculators_library_loads_converts_and_reproduces_our_block(tmp_path, tiny_tokenizer):
    from conftest import build_tiny_llama

    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    export, drafter = export_dflash(target, tmp_path / "export")
    verifier = tmp_path / "verifier"
    target.model.save_pretrained(verifier)
    spec = to_speculators(export, tmp_path / "spec", str(verifier))
    zlab = to_zlab(export, tmp_path / "zlab")
    g = torch.Generator().manual_seed(7)
    taps = torch.randn(1, 6, 3 * target.hidden_size, generator=g)
    verified = torch.tensor([5])
    with torch.no_grad():
        _, logits = drafter.draft_greedy(taps, verified)  # [1, block_size - 1, V]
    ref = tmp_path / "ref.safetensors"
    save_file(
        {
            "taps": taps,
            "block": drafter.block_tokens(verified),
            "logits": logits,
            "embed": target.embed_weight.detach().float().clone(),
            "lm_head": target.lm_head_weight.detach().float().clone(),
        },
        str(ref),
    )
    proc = subprocess.run(
        [
            str(SPECULATORS_PYTHON),
            "-c",
            SPECULATORS_SCRIPT,
            str(spec),
            str(zlab),
            str(verifier),
            str(ref),
            str(tmp_path / "converted"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert all(k in proc.stdout for k in ("WEIGHTS_OK", "CONVERTER_OK", "FORWARD_OK")), proc.stdout


# ---- llama.cpp: its own converter, then --spec-type draft-dflash (the `make llamacpp` build)
LLAMACPP_REQUIRED = (
    "fc.weight",
    "enc.output_norm.weight",
    "output_norm.weight",
)  # dflash.cpp load_arch_tensors
LLAMACPP_LAYER = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_q_norm",
    "attn_k_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_down",
    "ffn_up",
)


def gguf_tensors_and_fields(
    path: Path, root: Path
) -> tuple[dict[str, tuple[int, ...]], dict[str, object]]:
    """Tensor name -> shape (ggml order) and the ``dflash.*`` / mask metadata, read with the build's
    own gguf-py."""
    code = (
        "import json, sys; from gguf import GGUFReader; r = GGUFReader(sys.argv[1]);"
        " print(json.dumps({'tensors': {t.name: [int(n) for n in t.shape] for t in r.tensors},"
        " 'fields': {k: f.contents() for k, f in r.fields.items() if k.startswith(('dflash.',"
        " 'tokenizer.ggml.mask'))}}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root / "gguf-py")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    return {k: tuple(v) for k, v in out["tensors"].items()}, out["fields"]


@pytest.fixture(scope="module")
def embedded_gguf(tmp_path_factory) -> SimpleNamespace:
    """A random DFlash drafter (block 4, 1 layer, default taps (2, 15, 28)) for the embedded target,
    converted once by ``draftsmith export --format gguf``. Norm weights stay 1 so its drafts depend
    on the tapped hidden states.
    """
    from draftsmith import assets
    from draftsmith.bench import llamacpp_build
    from draftsmith.export.gguf import read_manifest

    reason = llamacpp_build.missing_build_reason()
    if reason:
        pytest.skip(f"llama.cpp {reason}")
    tmp = tmp_path_factory.mktemp("dflash-gguf")
    target = Target.load(str(assets.default_target_dir()), dtype="float32")
    export, drafter = export_dflash(
        target, tmp / "export", layers=None, block=4, num_layers=1, norms=False
    )
    assert main(["export", str(export), "--format", "gguf", "--out", str(tmp / "gguf")]) == 0
    return SimpleNamespace(
        target=target,
        export=export,
        drafter=drafter,
        manifest=read_manifest(tmp / "gguf"),
        root=llamacpp_build.llamacpp_dir(),
    )


@pytest.mark.integration
def test_real_conversion_and_engine_check_on_the_embedded_target(embedded_gguf):
    from draftsmith.evals.engine_check import engine_check
    from draftsmith.evals.engine_check_report import markdown

    manifest, drafter, target = embedded_gguf.manifest, embedded_gguf.drafter, embedded_gguf.target
    assert (manifest["spec_type"], manifest["draft_n_max"]) == ("draft-dflash", 3)
    tensors, fields = gguf_tensors_and_fields(Path(manifest["paths"]["draft"]), embedded_gguf.root)
    h, taps = target.hidden_size, list(drafter.tapped_layers)
    want = {*LLAMACPP_REQUIRED, *(f"blk.0.{n}.weight" for n in LLAMACPP_LAYER)}
    assert set(tensors) == want and tensors["fc.weight"] == (
        len(taps) * h,
        h,
    )  # no token_embd / output: the target's
    # captured at those layers' inputs: our hidden_states indices
    assert fields["dflash.target_layers"] == taps
    assert (fields["dflash.block_size"], fields["tokenizer.ggml.mask_token_id"]) == (
        4,
        drafter.config.mask_token_id,
    )
    assert fields["dflash.attention.causal"] is False
    paths = manifest["paths"]
    result = engine_check(embedded_gguf.export, paths["target"], paths["draft"], "mtbench", 1, 8)
    lc = result["llamacpp"]
    assert lc["lossless"] or lc["near_ties_only"], (
        lc["divergences"],
        lc["plain"]["texts"],
        lc["speculative"]["texts"],
    )
    assert (
        lc["speculative"]["spec_type"] == "draft-dflash" and lc["speculative"]["n_draft_max"] == 3
    )
    assert lc["speculative"]["n_drafted"] > 0 and lc["speculative"]["n_predict"] >= 8
    assert result["prompt_ids_match"] and result["runtime"]["lossless"]
    assert "llama.cpp DFlash (n_max 3)" in markdown(result)


_CANDIDATE = re.compile(r"draft candidate\s+0, pos\s+\d+:\s+(\d+)")
_ACCEPTED = re.compile(r"accepted (\d+)/\d+ draft tokens, the last target token is: \((\d+)\)")


def llamacpp_steps(log: str) -> list[tuple[list[int], int, int]]:
    """(drafted ids, accepted count, next verified token) per step of a ``-v``
    ``llama-speculative-simple`` log."""
    steps, drafted = [], []
    for line in log.splitlines():
        if m := _CANDIDATE.search(line):
            drafted.append(int(m.group(1)))
        elif m := _ACCEPTED.search(line):
            steps.append((drafted, int(m.group(1)), int(m.group(2))))
            drafted = []
    return steps


@pytest.mark.integration
def test_llamacpp_drafts_our_block_from_the_same_hidden_states(embedded_gguf):
    """llama.cpp's drafted tokens, step by step, equal our drafter's greedy block over the same
    context; read one ``hidden_states`` index off (either way) and they do not: the GGUF taps
    exactly what the drafter trained on.
    """
    from draftsmith.bench import llamacpp, llamacpp_speculative
    from draftsmith.bench.prompts import load_prompts

    target, drafter, paths = (
        embedded_gguf.target,
        embedded_gguf.drafter,
        embedded_gguf.manifest["paths"],
    )
    prompt = load_prompts("mtbench", target.tokenizer, 1)[0]
    text = llamacpp.prompt_texts([prompt], target.tokenizer)[0]
    argv = llamacpp_speculative.speculative_command(
        Path(paths["target"]), Path(paths["draft"]), text, 8, 3, 2, 1024
    )
    argv[argv.index("draft-eagle3")] = "draft-dflash"
    proc = subprocess.run(
        [*argv, "-v"], capture_output=True, text=True, errors="replace", timeout=300
    )
    steps = llamacpp_steps(proc.stderr)
    assert proc.returncode == 0 and len(steps) >= 8, proc.stderr[-2000:]
    with torch.no_grad():
        verified = int(
            target.model(torch.tensor([prompt])).logits[0, -1].argmax()
        )  # llama.cpp's first token
    seq, hits = list(prompt), {-1: 0, 0: 0, 1: 0}
    for drafted, accepted, following in steps:
        with torch.no_grad():
            hidden = target.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
            for shift in hits:
                taps = torch.cat([hidden[t + shift] for t in drafter.tapped_layers], -1)
                ours = drafter.draft_greedy(taps, torch.tensor([verified]))[0][0].tolist()
                hits[shift] += sum(a == b for a, b in zip(ours, drafted, strict=True))
        seq, verified = seq + [verified] + drafted[:accepted], following
    total = sum(len(d) for d, _, _ in steps)
    assert hits[0] >= 0.9 * total, (
        hits,
        total,
    )  # BF16 llama.cpp vs our fp32: a near-tie may flip, rarely
    assert hits[-1] <= 0.5 * total and hits[1] <= 0.5 * total, (hits, total)
