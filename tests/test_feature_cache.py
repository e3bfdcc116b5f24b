"""Offline feature cache (issue 14): write once, train without the target, same weights as online
training (the caches a run refuses: test_feature_cache_refusals.py)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch

from draftsmith.cli.training import compose_config
from draftsmith.distill.engine.trainer import train
from draftsmith.distill.feature_cache.build import build_cache
from draftsmith.distill.feature_cache.cached_data import open_cache, train_offline
from draftsmith.distill.feature_cache.manifest import FeatureCacheError
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.export.format import read_export
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.unit

# a few shards for 64 tiny conversations (fp32: 4 x 64 x 4 + 6 = 1030 bytes/token)
SHARD_BYTES = 60_000


def overrides(target_dir: Path, data_file: Path, *extra: str) -> list[str]:
    return [
        "recipe=eagle3",
        f"target.name_or_path={target_dir}",
        "target.dtype=fp32",
        f"data.spec={data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=4",
        "run.checkpoint_every=100",
        "run.final_eval_batches=1",
        "optim.warmup_steps=0",
        "drafter.target_layers=[1,2,3]",
        "drafter.draft_vocab_size=40",
        *extra,
    ]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "draftsmith-cache"))


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> Target:
    return Target.load(str(tiny_target_dir), "fp32")


@pytest.fixture(scope="module")
def fp32_cache(tmp_path_factory, tiny_target_dir, tiny_data_file, target) -> Path:
    out = tmp_path_factory.mktemp("cache") / "fp32"
    cfg = compose_config(overrides(tiny_target_dir, tiny_data_file))
    build_cache(
        cfg, get_recipe("eagle3"), out, dtype="fp32", shard_bytes=SHARD_BYTES, target=target
    )
    return out


def data_bytes(path: Path) -> int:
    """Bytes of a safetensors file without its header (8-byte length + JSON header)."""
    with open(path, "rb") as fh:
        header = struct.unpack("<Q", fh.read(8))[0]
    return path.stat().st_size - 8 - header


def test_training_from_the_cache_gives_the_online_weights(
    tmp_path, fp32_cache, tiny_target_dir, tiny_data_file, monkeypatch
):
    """4 steps of EAGLE-3 (TTT, reduced draft vocabulary counted on the data) online and from an
    fp32 cache over the same batches: equal drafter weights within 1e-6 (the same fp32 operations;
    logits rebuilt by the same matmul).
    """
    recipe = get_recipe("eagle3")
    online_cfg = compose_config(overrides(tiny_target_dir, tiny_data_file))
    online = train(online_cfg, recipe, tmp_path / "online")
    start = recipe.build(online_cfg, Target.load(str(tiny_target_dir), "fp32")).module.state_dict()

    from transformers import AutoModelForCausalLM

    def no_target(*args, **kwargs):
        raise AssertionError("offline training loaded the target")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_target)
    cfg = compose_config(overrides(tiny_target_dir, tiny_data_file, f"data.features={fp32_cache}"))
    offline = train_offline(cfg, recipe, tmp_path / "offline")
    assert offline["steps"] == online["steps"] == 4 and offline["tokens"] == online["tokens"]
    config_on, on = read_export(tmp_path / "online" / "export")
    config_off, off = read_export(tmp_path / "offline" / "export")
    # the cache records the target's identity for the export
    assert config_off["target"] == config_on["target"]
    assert sorted(on) == sorted(off)
    assert any(not torch.equal(start[k], on[k]) for k in on)  # training moved the weights
    for key in on:
        torch.testing.assert_close(off[key], on[key], rtol=0, atol=1e-6, msg=key)


def test_the_cache_records_its_build_cost_and_the_training_tokens_it_holds(fp32_cache, tmp_path):
    """What `draftsmith curve` bills a cached run: the CPU time of every shard (in its header) and
    the train split's non-padding tokens, counted as training counts them (the attention mask)."""
    from safetensors import safe_open

    from draftsmith.common.cache_costs import build_cpu_seconds

    manifest = json.loads((fp32_cache / "manifest.json").read_text())
    assert build_cpu_seconds(fp32_cache, manifest["shards"]) > 0
    counted = {"train": 0, "val": 0}
    for shard in manifest["shards"]:
        with safe_open(str(fp32_cache / shard["file"]), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(".attention_mask"):
                    counted[key.split(".", 1)[0]] += int(handle.get_tensor(key).sum())
    assert manifest["nonpad_tokens"] == counted and counted["train"] > 0
    partial = [*manifest["shards"], {"file": "shard-99999.safetensors", "tokens": 1}]
    assert build_cpu_seconds(fp32_cache, partial) is None  # a shard missing: the cost is not known


def test_printed_bytes_per_token_match_the_files(tmp_path, tiny_target_dir, tiny_data_file, capsys):
    """``draftsmith cache-features`` (bf16): the printed bytes/token x tokens is exactly the shards'
    tensor bytes."""
    from draftsmith.cli.training import _cmd_cache_features as cache_features_main

    out = tmp_path / "bf16"
    argv = [*overrides(tiny_target_dir, tiny_data_file), "--out", str(out), "--shard-mb", "0.03"]
    assert cache_features_main(argv) == 0
    text = capsys.readouterr().out
    found = re.search(r"(\d+) bytes/token .* x ([\d,]+) tokens", text)
    assert found, text
    bpt, tokens = int(found[1]), int(found[2].replace(",", ""))
    # 3 layer taps + final hidden in bf16, int32 id, two uint8 masks, the target's int32 greedy id
    # (EAGLE-3 reads its logits lazily)
    assert bpt == 4 * 64 * 2 + 6 + 4
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) > 1
    assert sum(data_bytes(p) for p in shards) == bpt * tokens
    overhead = sum(p.stat().st_size for p in shards) - bpt * tokens
    assert 0 < overhead < 0.05 * bpt * tokens  # headers only
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["complete"] and manifest["tokens"] == tokens and manifest["bytes_per_token"] == bpt
    )


def test_an_interrupted_cache_resumes_after_the_last_complete_shard(
    tmp_path, fp32_cache, tiny_target_dir, tiny_data_file, target, monkeypatch
):
    cfg = compose_config(overrides(tiny_target_dir, tiny_data_file))
    out = tmp_path / "resumed"
    build_cache(
        cfg,
        get_recipe("eagle3"),
        out,
        dtype="fp32",
        shard_bytes=SHARD_BYTES,
        target=target,
        stop_after=1,
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and [p.name for p in out.glob("shard-*")] == [
        "shard-00000.safetensors"
    ]
    (out / ".shard-00001.safetensors.tmp-999").write_bytes(
        b"half a shard"
    )  # a write killed mid-way
    train_cfg = compose_config(overrides(tiny_target_dir, tiny_data_file, f"data.features={out}"))
    with pytest.raises(
        FeatureCacheError, match=r"incomplete \(\d+ of \d+ shards missing: shard-00001"
    ):
        open_cache(train_cfg)

    calls = []
    features = Target.features
    monkeypatch.setattr(
        Target,
        "features",
        lambda self, ids, *a, **k: calls.append(ids.shape[0]) or features(self, ids, *a, **k),
    )
    build_cache(
        cfg, get_recipe("eagle3"), out, dtype="fp32", shard_bytes=SHARD_BYTES, target=target
    )
    first = manifest["shards"][0]["stop"] - manifest["shards"][0]["start"]
    # + 1 logits check
    assert len(calls) == 1 + sum(s["stop"] - s["start"] for s in manifest["shards"]) - first
    assert not list(out.glob(".shard-*"))
    for shard in manifest["shards"]:  # byte for byte the uninterrupted cache
        assert (out / shard["file"]).read_bytes() == (fp32_cache / shard["file"]).read_bytes(), (
            shard["file"]
        )
    assert json.loads((out / "manifest.json").read_text())["complete"]


def test_lazy_logits_rebuild_only_the_asked_rows_and_an_old_cache_rebuilds_all(fp32_cache, target):
    """EAGLE-3 reads its teacher lazily: the cache stores the target's greedy ids, and the cached
    target hands out the final hidden state + LM head instead of [B, T, V] logits; the rows it
    rebuilds equal the online logits'. A cache without greedy ids (written before they existed)
    falls back to rebuilding all the logits.
    """
    from dataclasses import replace

    from draftsmith.distill.feature_cache.cached_data import FeatureCache
    from draftsmith.distill.feature_cache.cached_target import CachedTarget
    from draftsmith.distill.feature_cache.manifest import PREFIX

    cache = FeatureCache(fp32_cache)
    assert cache.manifest["taps"]["lazy_logits"] is True
    batch = cache.batch("train", 0)
    cached = CachedTarget(cache)
    taps = FeatureTaps(final_hidden=False, layers=(1, 2, 3), logits=True, lazy_logits=True)
    lazy, _ = cached.batch_features(batch, taps)
    online = target.features(
        batch["input_ids"],
        batch["attention_mask"],
        replace(taps, final_hidden=True, lazy_logits=False),
    )  # the [B, T, V] logits
    assert lazy.logits is None and torch.equal(lazy.greedy(), online.logits.argmax(-1))
    rows, cols = torch.tensor([0, 0, 1]), torch.tensor([2, 5, 3])
    ids = torch.tensor([4, 9, 17, 30])
    torch.testing.assert_close(
        lazy.logits_at(rows, cols, ids), online.logits[rows, cols][:, ids], rtol=0, atol=1e-5
    )
    old = {k: v for k, v in batch.items() if k != PREFIX + "greedy_ids"}
    full, _ = cached.batch_features(old, taps)
    assert full.logits is not None and full.logits.shape[-1] == target.vocab_size
    torch.testing.assert_close(
        full.logits_at(rows, cols, ids), online.logits[rows, cols][:, ids], rtol=0, atol=1e-5
    )
