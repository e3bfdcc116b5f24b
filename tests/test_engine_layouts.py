"""Converted Medusa exports (vLLM and TGI layouts) against the key lists the engines' own loaders
read: zero unknown, zero missing, right shapes, and the engine's logits equal ours (the SGLang
EAGLE-3 layout: test_sglang_layout.py).

Each ``*_load`` helper below re-implements ONLY an engine's name mapping (which checkpoint name
lands in which parameter, which names it skips) and its parameter list with shapes, written down
from these sources:

* vLLM Medusa: vllm-project/vllm ``vllm/model_executor/models/medusa.py`` @
  09cddad8f0324594022359cd2b07e962a14b895f (``load_weights`` identical @
  01dbb08195ca9c70ac9044786a906a353e07fcdf) and ``vllm/transformers_utils/configs/medusa.py`` @
  0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f (keys holding "num" and "heads"/"layers" renamed to
  ``num_heads``/``num_hidden_layers``).
* TGI Medusa: huggingface/text-generation-inference
  ``server/text_generation_server/layers/medusa.py`` @ 91560ed931b217ddb1ee152891d20440fef331d4
  (``MedusaHeadV1``: ``{i}.{j}.linear`` with bias, ``{i}.{n}.weight`` for ``i < speculate``),
  ``layers/speculative.py`` @ c09f5bc93071e2701e201bb374d488e4673fac3d (a speculator config WITH
  ``architectures`` is never read as Medusa), ``models/__init__.py`` (``medusa_num_heads`` in the
  config -> ``base_model_name_or_path`` + ``medusa_lm_head.safetensors``; stored copy read 2026-05);
  state-dict names as in FasterDecoding/Medusa ``medusa/model/medusa_model.py`` @
  60eeab92e98adb0e787987493b11fa38535a8260.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from safetensors.torch import load_file
from test_speculators_export import export_eagle3

from draftsmith.cli import main
from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import ExportError
from draftsmith.export.medusa_layout import to_medusa_layout
from draftsmith.export.medusa_tgi import to_medusa_tgi
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree

pytestmark = pytest.mark.unit


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def medusa_export(
    target: Target,
    out: Path,
    share: bool = False,
    draft_ids: torch.Tensor | None = None,
    num_layers: int = 1,
) -> tuple[Path, MedusaHeads]:
    torch.manual_seed(0)
    arch = MedusaConfig(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_heads=3,
        num_layers=num_layers,
        share_lm_head=share,
        draft_vocab_size=None if draft_ids is None else int(draft_ids.numel()),
    )
    heads = MedusaHeads(arch, target.lm_head_weight.float(), draft_ids=draft_ids)
    for p in heads.parameters():
        p.data.normal_(0, 0.1)
    objective = MedusaObjective(
        heads, 0.8, "dataset", 5, default_tree(3, 8, 4), {"top_k": 4, "verifier": "greedy"}
    )
    module = SimpleNamespace(
        drafter=heads, objective=objective, run_info={"target": target.identity()}
    )
    return export_from_module(module, out, training={}), heads


def vllm_medusa_config(raw: dict) -> dict:
    """``MedusaConfig.from_pretrained``: keys with "num" and "heads" / "layers" renamed, then the
    defaults."""
    cfg = dict(raw)
    for k in list(cfg):
        if "num" in k and "heads" in k:
            cfg["num_heads"] = cfg.pop(k)
        elif "num" in k and "layers" in k:
            cfg["num_hidden_layers"] = cfg.pop(k)
    cfg = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5, "num_hidden_layers": 1, **cfg}
    cfg["truncated_vocab_size"] = cfg.get("truncated_vocab_size") or cfg["vocab_size"]
    return cfg


def vllm_medusa_load(raw: dict, tensors: dict[str, torch.Tensor]) -> SimpleNamespace:
    """vLLM ``Medusa.__init__`` parameters and ``load_weights`` mapping over ``tensors``."""
    cfg = vllm_medusa_config(raw)
    h, rows = cfg["hidden_size"], cfg["truncated_vocab_size"]
    params = {
        f"blocks.{i}.layers.{j}.{p}": (h, h) if p == "weight" else (h,)
        for i in range(cfg["num_heads"])
        for j in range(cfg["num_hidden_layers"])
        for p in ("weight", "bias")
        if p == "weight" or cfg.get("medusa_fc_bias", False)
    }
    original = cfg.get("original_lm_head", False)
    params.update(
        {"lm_head.weight": (rows, h)}
        if original
        else {f"lm_heads.{i}.weight": (rows, h) for i in range(cfg["num_heads"])}
    )
    weights, unknown, token_map = {}, [], None
    for name, w in tensors.items():
        name = name.replace("medusa_heads.", "")
        if name == "token_map":
            if rows < cfg["vocab_size"]:
                token_map = w
            else:
                unknown.append(name)  # read and thrown away
        elif name in params:
            weights[name] = w
        elif original and name == "lm_heads.0.weight":
            weights["lm_head.weight"] = w
        else:
            unknown.append(name)
    wrong = []
    for name, w in weights.items():
        if "lm_head" in name and token_map is not None and w.shape[0] > token_map.shape[0]:
            w = w[token_map]
        if tuple(w.shape) != params[name]:
            wrong.append((name, tuple(w.shape), params[name]))
    assert rows == cfg["vocab_size"] or token_map is not None, (
        "vLLM asserts a token_map for a truncated vocab"
    )
    return SimpleNamespace(
        unknown=unknown,
        missing=sorted(set(params) - set(weights)),
        wrong=wrong,
        cfg=cfg,
        token_map=token_map,
    )


def tgi_medusa_load(
    raw: dict, tensors: dict[str, torch.Tensor], vocab: int, hidden: int
) -> SimpleNamespace:
    """TGI's routing (``SpeculativeHead.load``) and ``MedusaHeadV1`` names over
    ``medusa_lm_head.safetensors``."""
    assert "architectures" not in raw, (
        "TGI reads a speculator config with `architectures` as no Medusa at all"
    )
    assert {"medusa_num_heads", "medusa_num_layers", "base_model_name_or_path"} <= set(raw)
    n = raw["medusa_num_layers"]
    params = {}
    for i in range(raw["medusa_num_heads"]):  # get_speculate() defaults to medusa_num_heads
        for j in range(n):
            params.update(
                {f"{i}.{j}.linear.weight": (hidden, hidden), f"{i}.{j}.linear.bias": (hidden,)}
            )
        params[f"{i}.{n}.weight"] = (
            vocab,
            hidden,
        )  # FastLinear(H -> V, bias=False): the full vocabulary
    return SimpleNamespace(
        unknown=sorted(set(tensors) - set(params)),
        missing=sorted(set(params) - set(tensors)),
        wrong=[(k, tuple(w.shape)) for k, w in tensors.items() if params.get(k, ()) != w.shape],
    )


def engine_medusa_logits(
    blocks: list[list[tuple[torch.Tensor, torch.Tensor]]],
    heads: list[torch.Tensor],
    x: torch.Tensor,
    vocab: int,
    token_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Both engines' head forward: ``x = x + SiLU(W x + b)`` per block, then the head; a token map
    scatters."""
    out = []
    for layers, head in zip(blocks, heads):
        y = x
        for w, b in layers:
            y = y + F.silu(F.linear(y, w, b))
        logits = F.linear(y, head)
        if token_map is not None:
            logits = torch.full((*logits.shape[:-1], vocab), -torch.inf).index_copy(
                -1, token_map, logits
            )
        out.append(logits)
    return torch.stack(out)


def our_target_logits(heads: MedusaHeads, x: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = heads(x)  # [K, T, V']
    if heads.draft_ids is None:
        return logits
    return torch.full((*logits.shape[:-1], vocab), -torch.inf).index_copy(
        -1, heads.draft_ids, logits
    )


CASES = {
    "own heads": {},
    "shared head": {"share": True},
    "draft vocab": {"draft_ids": torch.tensor([2, 5, 9, 40])},
    "shared head, draft vocab": {"share": True, "draft_ids": torch.tensor([2, 5, 9, 40])},
    "two blocks": {"num_layers": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_medusa_layout_matches_its_loader_and_logits(tmp_path, target, case):
    export, heads = medusa_export(target, tmp_path / "export", **CASES[case])
    out = to_medusa_layout(export, tmp_path / "vllm", target.lm_head_weight.float())
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # vLLM globs *.safetensors
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "medusa" and raw["architectures"] == ["MedusaModel"]
    assert "medusa_num_heads" not in raw  # TGI would take the folder for its own layout
    tensors = load_file(out / "model.safetensors")
    report = vllm_medusa_load(raw, tensors)
    assert (report.unknown, report.missing, report.wrong) == ([], [], [])
    cfg, v = report.cfg, target.vocab_size
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (
        3,
        heads.config.num_layers,
        v,
    )
    assert cfg["truncated_vocab_size"] == heads.config.head_vocab_size
    assert cfg["original_lm_head"] == heads.config.share_lm_head
    blocks = [
        [
            (tensors[f"blocks.{i}.layers.{j}.weight"], tensors[f"blocks.{i}.layers.{j}.bias"])
            for j in range(cfg["num_hidden_layers"])
        ]
        for i in range(3)
    ]
    lm = [
        tensors["lm_heads.0.weight" if cfg["original_lm_head"] else f"lm_heads.{i}.weight"]
        for i in range(3)
    ]
    x = torch.randn(5, target.hidden_size)
    with torch.no_grad():
        got = engine_medusa_logits(blocks, lm, x, v, report.token_map)
        assert torch.allclose(got, our_target_logits(heads, x, v), atol=1e-5)


@pytest.mark.parametrize("case", ["own heads", "shared head", "two blocks"])
def test_tgi_medusa_layout_matches_its_loader_and_logits(tmp_path, target, case):
    export, heads = medusa_export(target, tmp_path / "export", **CASES[case])
    out = to_medusa_tgi(export, tmp_path / "tgi", "org/base", target.lm_head_weight.float())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "medusa_lm_head.safetensors"]
    raw = json.loads((out / "config.json").read_text())
    assert raw["medusa_num_heads"] == 3 and raw["base_model_name_or_path"] == "org/base"
    tensors = load_file(out / "medusa_lm_head.safetensors")
    report = tgi_medusa_load(raw, tensors, target.vocab_size, target.hidden_size)
    assert (report.unknown, report.missing, report.wrong) == ([], [], [])
    n = raw["medusa_num_layers"]
    blocks = [
        [(tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"]) for j in range(n)]
        for i in range(3)
    ]
    x = torch.randn(5, target.hidden_size)
    with torch.no_grad():
        got = engine_medusa_logits(
            blocks, [tensors[f"{i}.{n}.weight"] for i in range(3)], x, target.vocab_size
        )
        assert torch.allclose(got, heads(x), atol=1e-5)


def test_the_medusa_checks_fail_on_unknown_and_missing_names(tmp_path, target):
    export, _ = medusa_export(target, tmp_path / "export")
    vllm_out = to_medusa_layout(export, tmp_path / "vllm")
    tgi_out = to_medusa_tgi(export, tmp_path / "tgi", "org/base")
    vllm_raw, tgi_raw = (json.loads((o / "config.json").read_text()) for o in (vllm_out, tgi_out))
    tgi_tensors = load_file(tgi_out / "medusa_lm_head.safetensors")
    crossed = vllm_medusa_load(vllm_raw, tgi_tensors)  # TGI names fed to vLLM's loader
    assert "0.0.linear.weight" in crossed.unknown and "blocks.0.layers.0.weight" in crossed.missing
    crossed = tgi_medusa_load(
        tgi_raw, load_file(vllm_out / "model.safetensors"), target.vocab_size, target.hidden_size
    )
    assert "lm_heads.0.weight" in crossed.unknown and "0.1.weight" in crossed.missing
    with pytest.raises(AssertionError, match="architectures"):
        tgi_medusa_load({**tgi_raw, "architectures": ["MedusaModel"]}, tgi_tensors, 1, 1)


def test_tgi_refuses_a_draft_vocabulary_and_the_cli_writes_all_three(tmp_path, target, capsys):
    reduced, _ = medusa_export(target, tmp_path / "reduced", draft_ids=torch.tensor([2, 5, 9]))
    with pytest.raises(ExportError, match="full vocabulary.*--format medusa"):
        to_medusa_tgi(reduced, tmp_path / "no", "org/base")
    assert not (tmp_path / "no").exists()
    medusa, _ = medusa_export(target, tmp_path / "medusa")
    eagle3, _ = export_eagle3(target, tmp_path / "eagle3")
    for source, fmt, marker in (
        (medusa, "medusa", "model.safetensors"),
        (medusa, "medusa-tgi", "medusa_lm_head.safetensors"),
        (eagle3, "sglang", "model.safetensors"),
    ):
        assert (
            main(["export", str(source), "--out", str(tmp_path / f"out-{fmt}"), "--format", fmt])
            == 0
        )
        assert (tmp_path / f"out-{fmt}" / marker).is_file()
    tgi = json.loads((tmp_path / "out-medusa-tgi" / "config.json").read_text())
    # the recorded target (an alias resolved to its folder)
    assert tgi["base_model_name_or_path"] == "tiny"
    assert main(["export", str(medusa), "--out", str(tmp_path / "bad"), "--format", "sglang"]) == 2
    assert "Medusa-1 exports as: draftsmith, medusa, medusa-tgi" in capsys.readouterr().err
