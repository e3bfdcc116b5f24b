"""``draftsmith export --format gguf`` and ``draftsmith engine-check --engine llamacpp``.

Unit: refusals (a method llama.cpp cannot run, a missing build, a converter refusal in one line),
the converter's input folder (speculators layout, target layer ids unchanged, no embedding) and the
parsing of ``llama-speculative-simple``'s output. Integration (the cached ``make llamacpp`` build
and the embedded SmolLM2 target): a random-weight EAGLE-3 drafter for the embedded target goes
through llama.cpp's real converter, then llama.cpp runs it speculatively on one MT-Bench prompt; its
text must equal llama.cpp's own plain greedy text.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from safetensors.torch import load_file

from draftsmith.bench import llamacpp_build, llamacpp_speculative
from draftsmith.cli.exporting import _convert, _to_gguf
from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.evals.engine_agreement import texts_lossless
from draftsmith.export.format import ExportError
from draftsmith.export.gguf import converter_input, refusal_line, run_converter
from draftsmith.recipes.eagle3 import objective as eagle3_recipe

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def export_eagle3(target: Target, out: Path, layers: list[int] | None, draft_vocab: int) -> Path:
    """An EAGLE-3 export of random weights for ``target`` (the drafter's shapes are what matters
    here)."""
    torch.manual_seed(0)
    cfg = recipe_config(
        "eagle3", {"drafter": {"target_layers": layers, "draft_vocab_size": draft_vocab}}
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randint(0, target.vocab_size, (2, 30), generator=g),
            torch.ones(2, 30, dtype=torch.long),
        )
    ]
    objective = eagle3_recipe.build_objective(cfg, target, batches)
    module = SimpleNamespace(
        drafter=objective.module, objective=objective, run_info={"target": target.identity()}
    )
    return export_from_module(module, out, training={})


@pytest.mark.parametrize(
    "method, label",
    [("hydra", "Hydra"), ("kangaroo", "Kangaroo"), ("medusa", "Medusa-1"), ("clover2", "Clover-2")],
)
def test_methods_llamacpp_cannot_run_are_refused_naming_their_formats(tmp_path, method, label):
    with pytest.raises(ValueError) as err:
        _convert(tmp_path, tmp_path / "out", "gguf", {"method": method}, None, source="runs/x")
    text = str(err.value)
    assert "--format gguf does not hold" in text and "EAGLE-3 drafters only" in text
    assert f"{label} exports as: draftsmith" in text
    if method == "medusa":
        assert "medusa, medusa-tgi" in text


def test_missing_build_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_build, "llamacpp_dir", lambda: tmp_path / "llamacpp-0.3.36")
    with pytest.raises(
        ValueError, match=r"llama.cpp's own converter, which is not built: run `make llamacpp`"
    ):
        _to_gguf(tmp_path, tmp_path / "out", str(tmp_path), None, "exp")


def test_a_converter_refusal_is_one_line(tmp_path):
    fake = tmp_path / "convert_hf_to_gguf.py"
    fake.write_text(
        "import sys\nprint('INFO:hf-to-gguf:Loading model', file=sys.stderr)\n"
        "print('ERROR:hf-to-gguf:Model Foo is not supported', file=sys.stderr)\nsys.exit(1)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(ExportError) as err:
        run_converter(tmp_path, tmp_path, tmp_path / "x.gguf")
    assert str(err.value).endswith("refused " + str(tmp_path) + ": Model Foo is not supported")
    assert "\n" not in str(err.value)
    assert (
        refusal_line("Traceback (most recent call last):\n  File x\nValueError: bad d2t\n")
        == "ValueError: bad d2t"
    )


def test_converter_input_is_the_speculators_layout_with_unshifted_layers_and_no_embedding(
    tmp_path, tiny_tokenizer
):
    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    export = export_eagle3(target, tmp_path / "export", [1, 2, 3], 48)
    folder = tmp_path / "in"
    converter_input(export, folder, tmp_path / "verifier")
    config = json.loads((folder / "config.json").read_text())
    # llama.cpp captures the input of layer id = HF hidden_states[id]: draftsmith's convention,
    # unshifted
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (
        config["draft_vocab_size"] == 48
        and config["transformer_layer_config"]["num_hidden_layers"] == 1
    )
    assert not config["norm_before_residual"] and not config["norm_before_fc"]
    tensors = load_file(folder / "model.safetensors")
    assert "embed_tokens.weight" not in tensors  # llama.cpp's decoder takes the target's
    assert tensors["d2t"].shape == (48,) and "layers.0.hidden_norm.weight" in tensors
    with pytest.raises(ExportError, match="exactly 3 target layers"):
        converter_input(
            export_eagle3(target, tmp_path / "e2", [1, 3], 48), tmp_path / "in2", tmp_path
        )


LOG = """0.07.442.127 I encoded   16 tokens in    0.803 seconds, speed:   19.926 t/s
0.07.442.150 I decoded    9 tokens in    4.555 seconds, speed:    1.976 t/s
0.07.442.177 I n_draft   = 4
0.07.442.190 I n_predict = 9
0.07.442.203 I n_drafted = 12
0.07.442.216 I n_accept  = 5
0.07.442.229 I accept    = 41.667%
"""


def test_speculative_simple_output_is_parsed():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    run = llamacpp_speculative.parse_speculative(
        "\n\n" + prompt + "Hello there\n\n\n\n", LOG, prompt
    )
    assert run["text"] == "Hello there"
    assert (run["n_draft"], run["n_predict"], run["n_drafted"], run["n_accept"]) == (4, 9, 12, 5)
    assert (run["prompt_tokens"], run["prompt_s"], run["decode_s"]) == (16, 0.803, 4.555)
    with pytest.raises(ValueError, match="n_drafted"):
        llamacpp_speculative.parse_speculative("", "crashed", prompt)
    assert texts_lossless("Paris.", True, "Paris.") and not texts_lossless(
        "Paris.", True, "Paris. It"
    )
    assert texts_lossless("The capital", False, "The capital of") and not texts_lossless(
        "The cap", False, "A"
    )


@pytest.mark.integration
def test_real_conversion_and_engine_check_on_the_embedded_target(tmp_path):
    reason = llamacpp_build.missing_build_reason()
    if reason:
        pytest.skip(f"llama.cpp {reason}")
    from draftsmith import assets
    from draftsmith.cli import main
    from draftsmith.evals.engine_check import engine_check
    from draftsmith.evals.engine_check_report import markdown
    from draftsmith.export.gguf import read_manifest

    target = Target.load(str(assets.default_target_dir()), dtype="float32")
    export = export_eagle3(target, tmp_path / "export", None, 2048)
    assert main(["export", str(export), "--format", "gguf", "--out", str(tmp_path / "gguf")]) == 0
    paths = read_manifest(tmp_path / "gguf")["paths"]
    assert (
        Path(paths["draft"]).stat().st_size > 0 and Path(paths["target"]).name == "target-bf16.gguf"
    )
    result = engine_check(export, paths["target"], paths["draft"], "mtbench", 1, 8, n_max=4)
    lc = result["llamacpp"]
    assert lc["lossless"] or lc["near_ties_only"], (
        lc["divergences"],
        lc["plain"]["texts"],
        lc["speculative"]["texts"],
    )
    assert lc["speculative"]["n_drafted"] > 0 and lc["speculative"]["n_predict"] >= 8
    assert result["prompt_ids_match"] and result["runtime"]["lossless"]
    assert "llama.cpp EAGLE-3 (n_max 4)" in markdown(result)
