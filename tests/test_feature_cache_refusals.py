"""A feature cache a run cannot use is refused, naming what differs: another target, data settings,
recipe or tapped layers (before anything loads, or at fit start), an incomplete folder, a build into
a folder made for another configuration, and a disk too small for the budget (nothing written)."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest
from test_feature_cache import SHARD_BYTES, overrides

from draftsmith.cli.training import compose_config
from draftsmith.distill.feature_cache.build import FeatureCacheError, build_cache
from draftsmith.distill.feature_cache.cached_data import open_cache, train_offline
from draftsmith.distill.target.frozen import Target
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.unit


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


def cached_cfg(target_dir: Path, data_file: Path, features: Path | None, *extra: str):
    """The EAGLE-3 run on the tiny target and data with ``extra`` overrides, reading the feature
    cache at ``features`` (none: a run that builds one)."""
    return compose_config(
        overrides(
            target_dir,
            data_file,
            *extra,
            *([f"data.features={features}"] if features else []),
        )
    )


def test_a_cache_for_another_target_data_recipe_or_layers_is_refused_naming_what_differs(
    tmp_path, fp32_cache, tiny_target_dir, tiny_data_file
):
    recipe = get_recipe("eagle3")
    # another target, other data settings: refused before anything loads, naming what differs
    with pytest.raises(
        FeatureCacheError, match=r"target\.name_or_path: cache '.*', now '/elsewhere'"
    ):
        train_offline(
            cached_cfg(
                tiny_target_dir, tiny_data_file, fp32_cache, "target.name_or_path=/elsewhere"
            ),
            recipe,
            tmp_path / "a",
        )
    with pytest.raises(FeatureCacheError, match=r"no target to shard"):
        train_offline(
            cached_cfg(tiny_target_dir, tiny_data_file, fp32_cache, "target.shard=true"),
            recipe,
            tmp_path / "s",
        )
    with pytest.raises(FeatureCacheError, match=r"data\.max_length: cache 48, now 40"):
        train_offline(
            cached_cfg(tiny_target_dir, tiny_data_file, fp32_cache, "data.max_length=40"),
            recipe,
            tmp_path / "b",
        )
    # another recipe
    with pytest.raises(FeatureCacheError, match=r"recipe: cache 'eagle3', now 'eagle'"):
        open_cache(
            compose_config(
                [
                    "recipe=eagle",
                    f"target.name_or_path={tiny_target_dir}",
                    f"data.spec={tiny_data_file}",
                    "data.limit=null",
                    "data.max_length=48",
                    "data.batch_size=4",
                    "data.val_fraction=0.1",
                    f"data.features={fp32_cache}",
                ]
            )
        )
    # the same recipe tapping other layers: refused at fit start, before the first step
    with pytest.raises(FeatureCacheError, match=r"needs layer 0"):
        train_offline(
            cached_cfg(
                tiny_target_dir, tiny_data_file, fp32_cache, "drafter.target_layers=[0,1,2]"
            ),
            recipe,
            tmp_path / "c",
        )


def test_incomplete_cache_folders_are_refused(
    tmp_path, fp32_cache, tiny_target_dir, tiny_data_file
):
    # incomplete folders
    with pytest.raises(FeatureCacheError, match=r"no manifest\.json"):
        open_cache(cached_cfg(tiny_target_dir, tiny_data_file, tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in fp32_cache.rglob("*"):
        if path.is_file() and path.name != "shard-00002.safetensors":
            dest = broken / path.relative_to(fp32_cache)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(path.read_bytes())
    with pytest.raises(
        FeatureCacheError, match=r"incomplete \(1 of \d+ shards missing: shard-00002"
    ):
        open_cache(cached_cfg(tiny_target_dir, tiny_data_file, broken))


def test_a_build_into_another_configurations_folder_or_a_disk_too_small_is_refused(
    tmp_path, fp32_cache, tiny_target_dir, tiny_data_file, target, monkeypatch
):
    recipe = get_recipe("eagle3")
    # a cache folder built for another configuration is never resumed into
    with pytest.raises(
        FeatureCacheError, match=r"another configuration .*data\.max_length.*another --out"
    ):
        build_cache(
            cached_cfg(tiny_target_dir, tiny_data_file, None, "data.max_length=40"),
            recipe,
            fp32_cache,
            dtype="fp32",
            shard_bytes=SHARD_BYTES,
            target=target,
        )
    # a disk too small: refused after printing the budget, nothing written
    from draftsmith.distill.feature_cache import (
        build as cache_build,
    )  # the module that reads the free space

    monkeypatch.setattr(
        cache_build.shutil, "disk_usage", lambda _p: namedtuple("du", "total used free")(1, 1, 1000)
    )
    small = tmp_path / "small"
    with pytest.raises(FeatureCacheError, match=r"needs 2.0\d MB more but .* has 1.00 kB free"):
        build_cache(
            cached_cfg(tiny_target_dir, tiny_data_file, None),
            recipe,
            small,
            dtype="fp32",
            shard_bytes=SHARD_BYTES,
            target=target,
        )
    assert not list(small.glob("*"))
