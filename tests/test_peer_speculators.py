"""The peer harness (tests/peer_trainer/) end to end on a tiny target: our conversations and
hidden states in speculators' data format, the real ``speculators.train`` (0.9.0, its own venv) on
CPU, its checkpoint imported by ``draftsmith import`` and served losslessly by our runtime. Skipped
with the reason when the speculators venv is missing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama, make_conversations
from safetensors.torch import load_file
from test_speculators_export import HAVE_SPECULATORS, SPECULATORS_PYTHON, _no_speculators_reason

from draftsmith.distill.data.conversations import normalize_record
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import read_export
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.registry import build_proposer
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "peer_trainer"


def load_script(name: str = "peer_speculators"):
    """A module of the peer harness, loaded by path (it is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, PEER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_data_matches_speculators_format(tmp_path, tiny_tokenizer):
    """hs_{i}: token_ids = input_ids, hidden_states [T, 4, H] = the three taps + the last layer
    before the norm."""
    data = load_script("speculators_data")
    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    convs = [normalize_record(c) for c in make_conversations(4)]
    samples = data.tokenized_samples(tiny_tokenizer, convs, 50, 64)
    sizes = data.write_peer_data(target, samples, (1, 2, 3), tmp_path, torch.float32)
    assert sizes["tokens"] >= 50 and sizes["samples"] == len(samples) >= 2
    hs = load_file(tmp_path / "hidden_states" / "hs_0.safetensors")
    ids = torch.tensor(samples[0]["input_ids"])
    assert torch.equal(hs["token_ids"], ids) and hs["hidden_states"].shape == (
        len(ids),
        4,
        target.hidden_size,
    )
    with torch.no_grad():
        out = target.model(ids[None], output_hidden_states=True)
    for k, layer in enumerate((1, 2, 3)):
        torch.testing.assert_close(hs["hidden_states"][:, k], out.hidden_states[layer][0])
    # HF's last hidden_states entry is after the final norm; ours is before it
    last = target.model.model.norm
    torch.testing.assert_close(
        last(hs["hidden_states"][:, 3]), out.hidden_states[-1][0], atol=1e-5, rtol=1e-5
    )
    # a dict of ints: no pickled code
    freq = torch.load(tmp_path / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == sizes["loss_tokens"]


def peer_arguments(target_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """The peer harness's command line for the tiny target: 600 tokens, taps 1-3, float32 hidden
    states, a 16-token draft vocabulary, the speculators venv's python; ``extra`` appended."""
    return [
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--tokens",
        "600",
        "--out",
        str(out),
        "--taps",
        "1",
        "2",
        "3",
        "--hs-dtype",
        "float32",
        "--max-length",
        "128",
        "--draft-vocab-size",
        "16",
        "--speculators-python",
        str(SPECULATORS_PYTHON),
        *extra,
    ]


def check_imported_checkpoint(report: dict) -> None:
    """The export ``draftsmith import`` made holds what the real trainer wrote, and no copy of the
    clone's uncommitted diff sits beside the checkpoint."""
    checkpoint = Path(report["checkpoint"])
    # no copy of the clone's uncommitted diff
    assert not (checkpoint.parent / "speculators.patch").exists()
    saved = load_file(checkpoint / "model.safetensors")  # what the real trainer wrote
    config, state = read_export(report["export"])
    assert (
        config["architecture"]["target_layers"] == [1, 2, 3]
        and config["architecture"]["draft_vocab_size"] == 16
    )
    assert torch.equal(state["d2t"], saved["d2t"]) and torch.equal(
        state["t2d"], saved["t2d"].bool()
    )
    assert torch.equal(
        state["layer.self_attn.q_proj.weight"], saved["layers.0.self_attn.q_proj.weight"].float()
    )


def check_served_losslessly(export: str, tokenizer) -> None:
    """Our runtime, drafting with the peer's export, emits exactly the target's greedy tokens."""
    model = build_tiny_llama(len(tokenizer))
    lean = LeanDecoder(
        ModelConfig.from_hf_dict(model.config.to_dict()),
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        kernel_backend="torch",
    ).eval()
    plain = SpeculativeDecoder(lean, build_proposer(export, lean, policy="chain", depth=2))
    prompt = tokenizer("what is the answer to the question .")["input_ids"]
    result = plain.generate(prompt, 16)
    want, seq = [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(16):  # plain greedy decoding of the target
            want.append(int(model(seq).logits[0, -1].argmax()))
            seq = torch.cat((seq, torch.tensor([[want[-1]]])), 1)
    assert result.tokens == want  # lossless with the peer's drafter


@pytest.mark.e2e  # the real trainer in its own venv (about 2 minutes on 2 cores)
@pytest.mark.skipif(not HAVE_SPECULATORS, reason=_no_speculators_reason())
def test_speculators_trainer_runs_on_cpu_and_its_checkpoint_serves(
    tmp_path, tiny_tokenizer, tiny_target_dir
):
    peer = load_script()
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in make_conversations(24)) + "\n")
    out = tmp_path / "peer"
    report = peer.main(peer_arguments(tiny_target_dir, data, out, "--timeout", "900"))
    assert report["data"]["tokens"] >= 600 and json.loads((out / "peer.json").read_text()) == report
    again = peer.main(peer_arguments(tiny_target_dir, data, out))
    # the re-run kept the data and the trained checkpoint
    assert again["seconds"] == report["seconds"]
    check_imported_checkpoint(report)
    check_served_losslessly(report["export"], tiny_tokenizer)


def test_the_peer_is_read_beside_the_curve_at_equal_tokens(tmp_path, monkeypatch):
    peer = load_script()
    from draftsmith.evals import learning_curve

    def fake_evaluate(export, settings, measure=False):
        return {
            name: {"first_position_acceptance": 0.3, "conditional_acceptance": [0.3, 0.5, 0.5, 0.5]}
            for name in settings.prompt_sets
        }, None

    monkeypatch.setattr(learning_curve, "evaluate_export", fake_evaluate)
    points = [
        {
            "steps": s,
            "tokens": t,
            "eval": {
                "mtbench": {"first_position_acceptance": a},
                "humaneval": {"first_position_acceptance": a / 2},
            },
        }
        for s, t, a in ((10, 1_000, 0.1), (100, 100_000, 0.5))
    ]
    (tmp_path / "curve.json").write_text(json.dumps({"points": points}))
    out = peer.evaluate_peer("unused", 10_000, tmp_path)
    assert out["first_position"] == {"mtbench": 0.3, "humaneval": 0.3}
    assert out["curve"]["first_position_at_equal_tokens"] == pytest.approx(
        {"mtbench": 0.3, "humaneval": 0.15}
    )
    assert (
        peer.evaluate_peer("unused", 10**7, tmp_path)["curve"]["first_position_at_equal_tokens"][
            "mtbench"
        ]
        is None
    )
