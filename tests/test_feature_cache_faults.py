"""Feature-cache faults: a shard cut short is named (never read) and written again by the re-run; a
`cache-features` process killed with SIGKILL in the middle of writing a shard resumes with the same
command to the byte-identical cache an uninterrupted run writes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_feature_cache import overrides  # the same tiny EAGLE-3 cache settings

from draftsmith.cli.training import compose_config
from draftsmith.distill.feature_cache.build import build_cache
from draftsmith.distill.feature_cache.cached_data import open_cache
from draftsmith.distill.feature_cache.manifest import FeatureCacheError
from draftsmith.distill.feature_cache.shards import shard_damage
from draftsmith.distill.target.frozen import Target
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 60_000


@pytest.fixture(autouse=True)
def _data_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "draftsmith-cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_target_dir, tiny_data_file) -> Path:
    """An uninterrupted fp32 cache (several shards)."""
    out = tmp_path_factory.mktemp("cache") / "reference"
    # module scope: set up before the autouse fixture above
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "draftsmith-cache"))
        build_cache(
            compose_config(overrides(tiny_target_dir, tiny_data_file)),
            get_recipe("eagle3"),
            out,
            dtype="fp32",
            shard_bytes=SHARD_BYTES,
            target=Target.load(str(tiny_target_dir), "fp32"),
        )
    return out


def copy_tree(source: Path, dest: Path) -> Path:
    for path in source.rglob("*"):
        if path.is_file():
            target = dest / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    return dest


def shards_equal(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("shard-*"))
    assert names and names == sorted(p.name for p in b.glob("shard-*"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_truncated_shard_is_named_and_written_again(
    tmp_path, reference, tiny_target_dir, tiny_data_file, caplog
):
    cut = copy_tree(reference, tmp_path / "cut")
    shard = cut / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # a copy that stopped 100 bytes short
    assert shard_damage(shard) is not None and shard_damage(reference / shard.name) is None
    train_cfg = compose_config(overrides(tiny_target_dir, tiny_data_file, f"data.features={cut}"))
    with pytest.raises(
        FeatureCacheError,
        match=r"damaged shards: shard-00001\.safetensors \(.*bytes where its header",
    ):
        open_cache(train_cfg)

    with caplog.at_level(logging.WARNING, logger="draftsmith.distill.feature_cache.build"):
        build_cache(
            compose_config(overrides(tiny_target_dir, tiny_data_file)),
            get_recipe("eagle3"),
            cut,
            dtype="fp32",
            shard_bytes=SHARD_BYTES,
            target=Target.load(str(tiny_target_dir), "fp32"),
        )
    assert "shard-00001.safetensors is damaged" in caplog.text
    shards_equal(cut, reference)
    assert open_cache(train_cfg).manifest["complete"]


def test_a_shard_whose_bytes_changed_is_named_at_first_read_and_written_again(
    tmp_path, reference, tiny_target_dir, tiny_data_file, caplog
):
    flipped = copy_tree(reference, tmp_path / "flipped")
    shard = flipped / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    # same size, one feature value changed on disk: it used to be trained on as it is
    data[-50] ^= 0x10
    shard.write_bytes(bytes(data))
    assert shard_damage(shard) is None  # the size check cannot see it
    cache = open_cache(
        compose_config(overrides(tiny_target_dir, tiny_data_file, f"data.features={flipped}"))
    )
    first = next(g for g in range(len(cache.where)) if cache.where[cache.key(g)] == shard.name)
    split, index = cache.key(first).split(".")
    with pytest.raises(
        FeatureCacheError,
        match=r"damaged shard: shard-00001\.safetensors \(its tensors do not match",
    ):
        cache.batch(split, int(index))
    with caplog.at_level(logging.WARNING, logger="draftsmith.distill.feature_cache.build"):
        build_cache(
            compose_config(overrides(tiny_target_dir, tiny_data_file)),
            get_recipe("eagle3"),
            flipped,
            dtype="fp32",
            shard_bytes=SHARD_BYTES,
            target=Target.load(str(tiny_target_dir), "fp32"),
        )
    assert "shard-00001.safetensors is damaged (its tensors do not match" in caplog.text
    shards_equal(flipped, reference)


@pytest.mark.parametrize("damage", ["manifest", "manifest-fields", "head", "target-config"])
def test_a_damaged_manifest_or_target_folder_is_one_line(
    damage, tmp_path, reference, tiny_target_dir, tiny_data_file
):
    from draftsmith.distill.feature_cache.cached_data import FeatureCache
    from draftsmith.distill.feature_cache.cached_target import CachedTarget

    broken = copy_tree(reference, tmp_path / damage)
    manifest = broken / "manifest.json"
    if damage == "manifest":
        manifest.write_text(manifest.read_text()[:200])  # a copy that stopped
    elif damage == "manifest-fields":
        manifest.write_text(json.dumps({"format": json.loads(manifest.read_text())["format"]}))
    elif damage == "head":
        head = next((broken / "target").glob("*.safetensors"))
        head.write_bytes(head.read_bytes()[:-64])
    else:
        (broken / "target" / "config.json").write_text("{not json")
    with pytest.raises(
        FeatureCacheError
    ) as refused:  # each used to be a traceback (JSON, KeyError, safetensors)
        CachedTarget(FeatureCache(broken))
    message = str(refused.value)
    assert "\n" not in message and str(broken) in message and "cache-features" in message, message


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from draftsmith.distill.feature_cache import build as feature_cache
    from draftsmith.cli import main
    written = []
    save = feature_cache.write_shard
    def write_then_die(path, tensors, meta):
        if len(written) == 2:  # the third shard: half of its temp file on disk, then kill -9
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
        save(path, tensors, meta)
        written.append(path)
    feature_cache.write_shard = write_then_die
    sys.exit(main(sys.argv[1:]))
""")


def test_cache_features_killed_mid_shard_resumes_to_the_same_cache(
    tmp_path, reference, tiny_target_dir, tiny_data_file
):
    out = tmp_path / "killed"
    argv = [
        "cache-features",
        *overrides(tiny_target_dir, tiny_data_file),
        "--out",
        str(out),
        "--dtype",
        "fp32",
        "--shard-mb",
        str(SHARD_BYTES / 1e6),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert len(list(out.glob("shard-*"))) == 2 and list(
        out.glob(".shard-*")
    )  # two whole shards, one cut temp
    assert not json.loads((out / "manifest.json").read_text())["complete"]

    again = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 already written" in again.stdout
    assert not list(out.glob(".shard-*"))
    shards_equal(out, reference)
    assert json.loads((out / "manifest.json").read_text())["complete"]
