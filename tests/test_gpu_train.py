"""``make gpu-train``'s packaging, proven on the CPU: files split across commands with their hashes,
put back together exactly, a truncated or corrupt part refused in one line (nothing written over a
good file), a step interrupted and run again; the training data compressed and installed where the
trainer finds it; the export coming back in parts under the device tool's limits."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "gpu_check"


def load(name: str):
    if str(HARNESS) not in sys.path:
        sys.path.append(str(HARNESS))
    spec = importlib.util.spec_from_file_location(name, HARNESS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def parcels():
    return load("parcels")


def blob(tmp_path: Path, size: int, seed: int = 0) -> Path:
    import random

    path = tmp_path / f"blob-{size}-{seed}.bin"
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def test_a_file_split_across_commands_comes_back_exactly(parcels, tmp_path):
    src = blob(tmp_path, 10_000)
    cmd1, cmd2 = tmp_path / "cmd1", tmp_path / "cmd2"
    entry = parcels.split_across(src, "target.gguf", [(cmd1, 6_000), (cmd2, None)])
    assert [p["bytes"] for p in entry["parts"]] == [6_000, 4_000] and entry["bytes"] == 10_000
    assert (cmd1 / "target.gguf.part00").is_file() and (cmd2 / "target.gguf.part01").is_file()
    for folder in (cmd1, cmd2):
        parcels.write_manifest(folder, {"target.gguf": entry})
    stash = tmp_path / "stash"
    assert parcels.stash(cmd1, stash) == ["target.gguf.part00"]  # command 1 keeps what it brought
    manifest = parcels.read_manifest(cmd2)
    out = parcels.assemble(
        manifest, "target.gguf", [stash, cmd2], tmp_path / "there" / "target.gguf"
    )
    assert out.read_bytes() == src.read_bytes()
    small = parcels.split_across(blob(tmp_path, 100, 1), "data", [(cmd1, 0), (cmd2, None)])
    assert [p["file"] for p in small["parts"]] == ["data.part01"]  # an empty share writes no part
    with pytest.raises(parcels.ParcelError, match="left over"):
        parcels.split_across(src, "short", [(cmd1, 10)])


def test_a_truncated_or_corrupt_part_is_refused_in_one_line(parcels, tmp_path):
    src = blob(tmp_path, 5_000)
    parcel = tmp_path / "parcel"
    manifest = parcels.split_files({"model.safetensors": src}, parcel, 2_000)
    dest = tmp_path / "out" / "model.safetensors"
    dest.parent.mkdir()
    dest.write_bytes(b"the good file from before")
    part = parcel / "model.safetensors.part01"
    whole = part.read_bytes()
    part.write_bytes(whole[:-7])  # a partial copy
    with pytest.raises(
        parcels.ParcelError,
        match=r"part01: 1,993 bytes, the manifest says 2,000 \(a partial copy\)",
    ):
        parcels.assemble(manifest, "model.safetensors", [parcel], dest)
    part.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # same size, other content
    with pytest.raises(parcels.ParcelError, match="corrupt") as err:
        parcels.assemble(manifest, "model.safetensors", [parcel], dest)
    assert "\n" not in str(err.value)
    assert dest.read_bytes() == b"the good file from before"  # nothing written over it
    part.unlink()
    with pytest.raises(parcels.ParcelError, match="part01: part missing"):
        parcels.assemble(manifest, "model.safetensors", [parcel], dest)
    (parcel / "manifest.json").write_text("{not json")
    with pytest.raises(parcels.ParcelError, match="unreadable parcel manifest"):
        parcels.read_manifest(parcel)


def test_an_interrupted_assembly_is_run_again_and_a_finished_one_kept(
    parcels, tmp_path, monkeypatch
):
    src = blob(tmp_path, 8_000)
    parcel = tmp_path / "parcel"
    manifest = parcels.split_files({"f": src}, parcel, 3_000)
    dest = tmp_path / "there" / "f"
    real_copy = parcels.shutil.copyfileobj
    calls = []

    def dies_midway(a, b, n):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while writing the second part
        return real_copy(a, b, n)

    monkeypatch.setattr(parcels.shutil, "copyfileobj", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        parcels.assemble(manifest, "f", [parcel], dest)
    assert not dest.exists()  # only a temporary was being written
    monkeypatch.setattr(parcels.shutil, "copyfileobj", real_copy)
    assert parcels.assemble(manifest, "f", [parcel], dest).read_bytes() == src.read_bytes()
    (parcel / "f.part00").unlink()  # a finished file is kept: its parts are not needed again
    assert parcels.assemble(manifest, "f", [parcel], dest).read_bytes() == src.read_bytes()
    stash = tmp_path / "stash"
    parcels.stash(parcel, stash)
    (stash / "f.part01").write_bytes(b"half")  # a stash cut short is copied again
    parcels.stash(parcel, stash)
    assert (stash / "f.part01").read_bytes() == (parcel / "f.part01").read_bytes()


def test_the_export_comes_back_in_parts_under_the_limits(parcels, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"method": "eagle3"}))
    blob(tmp_path, 9_500).rename(export / "model.safetensors")
    back = tmp_path / "OUT" / "export"
    manifest = parcels.pack_folder(export, back, 4_000, max_files=5)
    assert sorted(manifest["files"]) == ["config.json", "model.safetensors"]
    assert len(list(back.iterdir())) == 5 and all(p.stat().st_size <= 4_000 for p in back.iterdir())
    home = parcels.unpack_folder(back, tmp_path / "home" / "export")
    assert (home / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    with pytest.raises(parcels.ParcelError, match="needs 5 files .* only 4 can come back"):
        parcels.pack_folder(export, tmp_path / "other", 4_000, max_files=4)
    (back / "model.safetensors.part02").write_bytes(b"x")  # a part cut short on the way back
    with pytest.raises(parcels.ParcelError, match="partial copy"):
        parcels.unpack_folder(back, tmp_path / "home" / "export")
    assert (home / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()


def test_training_data_travels_compressed_and_lands_in_the_sample_cache(
    tmp_path, tiny_tokenizer, monkeypatch
):
    data = load("gpu_train_data")
    import numpy as np

    rng = np.random.default_rng(0)
    samples = [
        {
            "input_ids": rng.integers(0, 60, n).tolist(),
            "loss_mask": (rng.random(n) > 0.4).astype(int).tolist(),
        }
        for n in rng.integers(10, 60, 200)
    ]
    meta = {"tokenizer": data.tokenizer_fingerprint(tiny_tokenizer), "max_length": 64}
    encoded = data.choose_samples(samples, 1_500, meta)
    assert len(encoded) <= 1_500
    back, back_meta = data.decode_samples(encoded)
    assert 0 < back_meta["samples"] == len(back) < len(samples) and back_meta["max_length"] == 64
    by_ids = {tuple(s["input_ids"]): s["loss_mask"] for s in samples}
    assert all(
        by_ids[tuple(s["input_ids"])] == s["loss_mask"] for s in back
    )  # ids and masks exactly
    from draftsmith.distill.data.datamodule import ChatDataModule

    spec = tmp_path / "named.jsonl"
    spec.write_text(
        '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "the'
        ' answer"}]}\n'
    )
    module = ChatDataModule(
        tiny_tokenizer, str(spec), max_length=64, batch_size=2, cache_dir=tmp_path / "cache"
    )
    data.install_samples(module, back, back_meta)
    module.setup("fit")
    assert len(module.train_set) + len(module.val_set) == len(
        back
    )  # read from the cache, not tokenised again
    with pytest.raises(ValueError, match="tokenised with tokenizer"):
        data.install_samples(module, back, {**back_meta, "tokenizer": "other"})


def test_the_plan_the_device_calls_and_the_run_they_make(tmp_path):
    train = load("gpu_train")
    stages = sys.modules["gpu_train_stages"]
    calls = train.device_calls(train.REPO / ".gpu_train")
    assert (
        'carry=[".gpu_train/cmd1"]' in calls
        and 'carry=[".gpu_train/cmd2"]' in calls
        and "receive" in calls
    )
    args = SimpleNamespace(
        assumed_rate=100_000.0,
        tokens_per_step=65_536,
        min_steps=20,
        device="cuda",
        tiny=False,
        max_length=2048,
        max_steps=0,
    )
    assert stages.planned_steps(args, tmp_path, 300.0) == (
        389,
        100_000.0,
    )  # 300 s x 100K x 0.85 / 64K
    (tmp_path / "speed.json").write_text(
        json.dumps(
            {
                "ours": [
                    {"budget": 16_384, "train_tokens_per_s": 50_000.0},
                    {"budget": 65_536, "train_tokens_per_s": 200_000.0},
                ]
            }
        )
    )
    assert stages.planned_steps(args, tmp_path, 300.0) == (778, 200_000.0)
    args.max_steps = 3  # the rehearsal's cap
    assert stages.planned_steps(args, tmp_path, 300.0) == (3, 200_000.0)
    overrides = stages.training_overrides(
        args, Path("/t"), Path("/d.jsonl"), Path("/run"), 778, 500.0
    )
    assert {
        "trainer=gpu",
        "trainer.compile=true",
        "data.tokens_per_step=65536",
        "trainer.max_steps=778",
        "trainer.max_time=00:00:08:20",
        "data.max_length=2048",
    } <= set(overrides)
    proc = subprocess.run(
        ["bash", str(HARNESS / "gpu_train.sh"), "part2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    if proc.returncode == 3:  # no GPU here: one line naming the rehearsal
        assert "needs a CUDA GPU" in proc.stderr and "make gpu-train DRY_RUN=1" in proc.stderr
