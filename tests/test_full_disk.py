"""A full disk is a clean stop (issue 40): a checkpoint save or an export folder write that hits
ENOSPC removes its own temporary, keeps the last good checkpoint (or folder) in place, says in one
line which path and how much space it needs; the next run removes what an earlier failure left and
resumes. A fake full disk (a writer that raises OSError(ENOSPC) part-way) everywhere, and one real
tmpfs when this machine lets a test mount one."""

from __future__ import annotations

import errno
import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from export_faults import cli_error_line, dead_pid, fill_then_enospc, run_folder_of, tree_snapshot

from draftsmith.common.atomic_folder import DiskFullError, is_disk_full, write_file
from draftsmith.common.errors import DraftsmithError
from draftsmith.distill.engine.checkpoints import CheckpointDiskFull, QuotaCheckpoint, temporary_of
from draftsmith.export import format as export_format
from draftsmith.export.format import ExportDiskFullError, ExportError, write_export

pytestmark = pytest.mark.unit


def fake_trainer(run_dir: Path, save) -> SimpleNamespace:
    """What ``ModelCheckpoint._save_checkpoint`` uses of a Trainer: ``save_checkpoint`` is
    ``save``."""
    return SimpleNamespace(
        save_checkpoint=save,
        global_step=4,
        is_global_zero=True,
        loggers=[],
        default_root_dir=str(run_dir),
    )


def test_a_checkpoint_save_on_a_full_disk_removes_its_temporary_and_names_the_path(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step2.ckpt").write_bytes(b"\0" * 3_000_000)  # the last good checkpoint, 3 MB
    (folder / "last.ckpt").symlink_to("step2.ckpt")
    callback = QuotaCheckpoint(folder, every_n_train_steps=2)
    target = folder / "step4.ckpt"
    with pytest.raises(
        CheckpointDiskFull
    ) as err:  # as AtomicCheckpointIO writes: the temporary, then the rename
        callback._save_checkpoint(
            fake_trainer(tmp_path, lambda path, *_: fill_then_enospc(temporary_of(path))),
            str(target),
        )
    text = str(err.value)
    assert text.startswith(f"no space left on the device for {target}: it needs about 3.00 MB (")
    assert "last.ckpt still names step2.ckpt, where a re-run resumes" in text and "\n" not in text
    # train.py: one error line
    assert isinstance(err.value, DraftsmithError) and err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step2.ckpt"]
    assert (folder / "last.ckpt").resolve() == folder / "step2.ckpt"


def test_other_save_errors_keep_their_type_and_still_drop_the_temporary(tmp_path):
    callback = QuotaCheckpoint(tmp_path, every_n_train_steps=2)

    def broken(path, *_):
        temporary_of(path).write_bytes(b"half")
        raise RuntimeError("serialization bug")

    with pytest.raises(RuntimeError, match="serialization bug"):
        callback._save_checkpoint(fake_trainer(tmp_path, broken), str(tmp_path / "step4.ckpt"))
    assert list(tmp_path.iterdir()) == []


def test_the_next_run_removes_stale_checkpoint_temporaries_with_a_warning(tmp_path, caplog):
    stale = tmp_path / f".step40.ckpt.tmp-{dead_pid()}"
    stale.write_bytes(b"\0" * 1000)
    callback = QuotaCheckpoint(tmp_path, every_n_train_steps=2)
    trainer = SimpleNamespace(
        is_global_zero=True,
        fast_dev_run=False,
        default_root_dir=str(tmp_path),
        strategy=SimpleNamespace(broadcast=lambda x: x),
        log_dir=str(tmp_path),
    )
    with caplog.at_level(logging.WARNING):
        callback.setup(trainer, None, "fit")
    assert not stale.exists() and f"removing {stale}" in caplog.text


def test_disk_full_is_recognised_through_wrapping():
    inner = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise inner
        except OSError as err:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from err
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")) and not is_disk_full(
        OSError(errno.EACCES, "x")
    )


def test_an_export_on_a_full_disk_keeps_the_previous_one_and_says_so(
    capsys, tmp_path, medusa_export, monkeypatch
):
    run = run_folder_of(medusa_export, tmp_path / "run")
    out = tmp_path / "export"
    from draftsmith.cli import main

    assert main(["export", str(run), "--out", str(out)]) == 0
    before = tree_snapshot(out)
    monkeypatch.setattr(
        export_format, "save_file", lambda tensors, path, metadata=None: fill_then_enospc(path)
    )
    line = cli_error_line(capsys, ["export", str(run), "--out", str(out)])
    assert line.startswith(
        f"draftsmith export: error: no space left on the device for {out}: it needs about "
    )
    assert "the partial write was removed and nothing was replaced" in line
    assert tree_snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "export",
        "run",
    ]


def test_a_converted_layout_on_a_full_disk_leaves_nothing(tmp_path, medusa_export, monkeypatch):
    from draftsmith.export import medusa_layout

    monkeypatch.setattr(
        medusa_layout, "save_file", lambda tensors, path, metadata=None: fill_then_enospc(path)
    )
    with pytest.raises(ExportDiskFullError) as err:
        medusa_layout.to_medusa_layout(medusa_export, tmp_path / "vllm")
    assert isinstance(err.value, ExportError) and isinstance(err.value, DiskFullError)
    assert (
        f"for {tmp_path / 'vllm'}: it needs about" in str(err.value)
        and list(tmp_path.iterdir()) == []
    )


def test_write_file_on_a_full_disk_keeps_the_old_file(tmp_path):
    path = write_file(tmp_path / "bench.json", "{}\n")
    with pytest.raises(DiskFullError, match=f"no space left on the device for {path}"):
        write_file(path, lambda tmp: fill_then_enospc(tmp))
    assert path.read_text() == "{}\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "bench.json"
    ]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_real_full_tmpfs_stops_an_export_cleanly(small_tmpfs):
    config = {"method": "medusa", "architecture": {}, "target": {"name_or_path": "t"}}
    out = write_export(small_tmpfs / "export", {"w": torch.zeros(1000)}, config)  # 4 kB: fits
    before = tree_snapshot(out)
    with pytest.raises(ExportDiskFullError, match=r"it needs about 2\.00 MB \("):
        write_export(out, {"w": torch.zeros(500_000)}, config)  # 2 MB on a 1 MB disk
    assert tree_snapshot(out) == before and sorted(p.name for p in small_tmpfs.iterdir()) == [
        "export"
    ]


@pytest.mark.e2e
def test_training_stops_cleanly_on_a_full_disk_and_resumes_once_space_is_freed(
    tmp_path, tiny_target_dir, tiny_data_file, monkeypatch, caplog
):
    from draftsmith.cli.train_command_line import expand_shorthands
    from draftsmith.cli.training import compose_config
    from draftsmith.distill.engine.trainer import train
    from draftsmith.recipes import get_recipe

    run_dir = tmp_path / "run"
    cfg = compose_config(
        expand_shorthands(
            [
                "recipe=medusa",
                f"target={tiny_target_dir}",
                "target.dtype=fp32",
                f"data={tiny_data_file}",
                "data.limit=null",
                "data.max_length=48",
                "data.batch_size=4",
                "data.val_fraction=0.1",
                "trainer.max_steps=6",
                "run.checkpoint_every=2",
                "run.final_eval_batches=0",
                "optim.warmup_steps=0",
                "heads.num_heads=1",
                "run.export=false",
            ]
        )
    )
    real_save = torch.save

    def disk_fills_at_step4(
        obj, f, *args, **kwargs
    ):  # the disk is full from the step-4 checkpoint on
        if "step4.ckpt" in str(getattr(f, "name", f)):
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills_at_step4)
    with pytest.raises(CheckpointDiskFull) as err:
        train(cfg, get_recipe("medusa"), run_dir)
    folder = run_dir / "checkpoints"
    assert f"for {folder / 'step4.ckpt'}: it needs about" in str(
        err.value
    ) and "last.ckpt still names step2" in str(err.value)
    assert sorted(p.name for p in folder.iterdir() if "ckpt" in p.name) == [
        "last.ckpt",
        "step2.ckpt",
    ]  # no step 4
    monkeypatch.setattr(torch, "save", real_save)  # space freed
    # and a temporary some other failed attempt left
    stale = folder / f".step9.ckpt.tmp-{dead_pid()}"
    stale.write_bytes(b"\0" * 100)
    with caplog.at_level(logging.INFO):
        summary = train(cfg, get_recipe("medusa"), run_dir)
    assert f"resuming from {folder / 'step2.ckpt'}" in caplog.text and summary["steps"] == 6
    assert not stale.exists() and f"removing {stale}" in caplog.text
    assert (folder / "last.ckpt").resolve().name == "step6.ckpt"
