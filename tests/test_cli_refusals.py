"""Issue 40's serving-side refusals: every numeric flag of generate, bench and regenerate
range-checked where it is declared, before anything loads; messages naming the input, the problem
and the fix (fp16, a target folder given as a drafter, a binary prompts file); bench outputs checked
before the bench and written so a full disk leaves no 0-byte file."""

from __future__ import annotations

import builtins
import errno
import io
import json
from pathlib import Path

import pytest

from draftsmith.cli import main

pytestmark = pytest.mark.unit


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if a command gets as far as loading a model (a refusal must come first)."""
    from draftsmith.runtime import serving

    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded before the bad argument was refused")

    monkeypatch.setattr(serving, "load_runtime", refuse)


def refused(capsys, argv: list[str]) -> str:
    """Run ``argv`` in-process; assert exit 2 with exactly one line on stderr (no usage block, no
    traceback)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "usage:" not in err, (
        err
    )
    return err.strip()


PROG = {
    "generate": "generate",
    "bench": "bench export",
    "regenerate": "regenerate",
    "reward": "bench reward",
    "diffusion": "bench diffusion",
}  # bench without a mode word: its default mode, export
BASE = {
    "generate": ["generate", "--prompt", "hi"],
    "bench": ["bench", "--drafter", "/nonexistent/export"],
    "regenerate": ["regenerate", "--out", "/nonexistent/o.jsonl"],
    "reward": ["bench", "reward"],
    "diffusion": ["bench", "diffusion", "--target", "/nonexistent/dlm"],
}
# (command or bench mode, flag, a value out of its range, what the refusal says the range is): every
# numeric flag of generate, regenerate and each bench mode
OUT_OF_RANGE = [
    *[(c, "--max-new-tokens", "0", ">= 1") for c in ("generate", "bench", "regenerate", "reward")],
    *[(c, "--temperature", "-1", ">= 0") for c in BASE],
    *[(c, "--temperature", "inf", ">= 0") for c in BASE],
    *[(c, "--seed", "-1", ">= 0") for c in ("generate", "bench", "regenerate", "reward")],
    *[(c, "--num-prompts", "0", ">= 1") for c in ("bench", "reward", "diffusion")],
    ("reward", "--samples-per-prompt", "0", ">= 1"),
    ("reward", "--overhead-prompts", "-2", ">= 1"),
    ("diffusion", "--gen-length", "0", ">= 1"),
    ("diffusion", "--steps-per-block", "0", ">= 1"),
    ("diffusion", "--threshold", "1.5", "in (0, 1)"),
    ("bench", "--window", "0", ">= 1"),
    ("bench", "--parity-chain", "0", ">= 1"),
    ("bench", "--sweep-k", "1,-2", ">= 0"),
    ("reward", "--grid", "0,-0.5", ">= 0"),
    ("regenerate", "--limit", "0", ">= 1"),
    ("regenerate", "--skip", "-1", ">= 0"),
    ("regenerate", "--top-p", "0", "in (0, 1]"),
    ("regenerate", "--top-p", "1.5", "in (0, 1]"),
    ("regenerate", "--batch-size", "0", ">= 1"),
]


@pytest.mark.parametrize(("command", "flag", "value", "bounds"), OUT_OF_RANGE)
def test_every_numeric_flag_is_range_checked_before_anything_loads(
    capsys, nothing_loads, command, flag, value, bounds
):
    line = refused(capsys, [*BASE[command], flag, value])
    assert (
        line.startswith(f"draftsmith {PROG[command]}: error: {flag} ")
        and bounds in line
        and value in line
    ), line


def test_a_negative_temperature_is_refused_as_a_temperature_not_by_the_verifier(
    capsys, nothing_loads
):
    line = refused(capsys, ["bench", "--drafter", "/nonexistent/export", "--temperature", "-1"])
    assert line.startswith(
        "draftsmith bench export: error: --temperature must be >= 0, got -1 (the sampling "
        "temperature"
    )
    assert "verifier" not in line and "greedy verifier" not in line


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("fixed:-1", "fixed:-1: the draft depth K must be >= 0, got -1"),
        ("confidence:1.5", "confidence:1.5: the threshold must be in (0, 1), got 1.5"),
        ("confidence:0.3:0", "confidence:0.3:0: a draft depth must be >= 1, got 0"),
        ("learned:0.3:4:2", "learned:0.3:4:2: MIN_DEPTH 4 is above MAX_DEPTH 2"),
        ("fixed:two", "'fixed:two' is not a stop policy; use auto, export, none, fixed:K"),
    ],
)
def test_stop_policies_are_checked_as_they_are_written(capsys, nothing_loads, policy, says):
    line = refused(capsys, ["bench", "--drafter", "/nonexistent/export", "--stop-policy", policy])
    assert line.startswith("draftsmith bench export: error: --stop-policy") and says in line, line


def test_valid_values_still_parse():
    from draftsmith.cli import build_parser

    args = build_parser("bench").parse_args(
        [
            "bench",
            "--stop-policy",
            "confidence:0.4:6",
            "--temperature",
            "0.7",
            "--sweep-k",
            "0,1,2",
            "--dtype",
            "bf16",
            "--num-prompts",
            "3",
        ]
    )
    assert (args.stop_policy, args.temperature, args.sweep_k, args.dtype, args.num_prompts) == (
        "confidence:0.4:6",
        0.7,
        "0,1,2",
        "bf16",
        3,
    )


@pytest.mark.parametrize("command", ["generate", "bench", "regenerate"])
def test_fp16_is_refused_up_front_with_the_reason(capsys, nothing_loads, command):
    line = refused(capsys, [*BASE[command], "--dtype", "fp16"])
    assert (
        f"{PROG[command]}: error: --dtype: fp16 is not served: the runtime runs fp32 (exact) or"
        " bf16" in line
    )
    # why, not the fingerprint mismatch later
    assert "Use --dtype bf16 or fp32" in line and "fingerprint" in line


def test_a_target_folder_given_as_the_drafter_says_what_to_pass(
    capsys, nothing_loads, tiny_target_dir
):
    line = refused(capsys, ["bench", "--drafter", str(tiny_target_dir), "--max-new-tokens", "2"])
    assert (
        line
        == f"draftsmith bench: error: --drafter {tiny_target_dir} is a target model folder (llama),"
        f" not a draftsmith drafter export: pass it as --target {tiny_target_dir}, and --drafter"
        " the export a training run wrote (<run dir>/export, or `draftsmith export RUN --out"
        " DIR`)"
    )
    assert "format None" not in line


def test_a_binary_prompts_file_is_named(capsys, tiny_tokenizer, tmp_path):
    from draftsmith.bench.prompts import load_prompts

    binary = tmp_path / "prompts.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    with pytest.raises(
        ValueError, match=f"prompts file {binary} is not UTF-8 text .*pass a .jsonl with one"
    ):
        load_prompts(str(binary), tiny_tokenizer, None)
    listing = tmp_path / "list.jsonl"
    listing.write_text('["not", "an", "object"]\n')
    with pytest.raises(ValueError, match=f"{listing}:1: a JSON list, not an object"):
        load_prompts(str(listing), tiny_tokenizer, None)


def test_a_binary_regenerate_data_file_is_named(tmp_path):
    from draftsmith.datagen.regenerate import regenerate

    binary = tmp_path / "data.jsonl"
    binary.write_bytes(b"\xff\xfe\x00binary\x00" * 64)
    with pytest.raises(ValueError, match=f"--data {binary} is not UTF-8 text"):
        regenerate(str(binary), tmp_path / "o.jsonl")


def test_bench_out_that_cannot_be_written_fails_before_the_bench(
    capsys, nothing_loads, tmp_path, medusa_export
):
    blocker = tmp_path / "a-file"
    blocker.write_text("the user's")
    for out in (blocker, blocker / "sub"):  # a file, and a folder that cannot be made under a file
        line = refused(capsys, ["bench", "--drafter", str(medusa_export), "--out", str(out)])
        assert (
            line.startswith(f"draftsmith bench: error: --out {out} ")
            and "nothing was written" in line
        ), line
    assert blocker.read_text() == "the user's"


def _full_disk_open(real_open, names: tuple[str, ...]):
    """``open`` where writing a file whose name contains one of ``names`` fails as a full disk does
    (the file is created first, as a real full disk leaves it)."""

    class Full(io.RawIOBase):
        def __init__(self, handle):
            self.handle = handle

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.handle.close()
            super().close()

    def fake(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if any(n in Path(str(file)).name for n in names) and ("w" in mode or "a" in mode):
            return Full(handle)
        return handle

    return fake


def test_a_full_disk_while_writing_bench_json_leaves_no_empty_file_and_names_it(
    monkeypatch, tmp_path
):
    from draftsmith.bench.report import write_outputs

    out = tmp_path / "b"
    out.mkdir()
    fake = _full_disk_open(builtins.open, ("bench.json",))
    monkeypatch.setattr(builtins, "open", fake)
    monkeypatch.setattr(io, "open", fake)
    with pytest.raises(OSError) as caught:
        write_outputs({"method": "medusa"}, out)
    monkeypatch.undo()
    assert str(out / "bench.json") in str(caught.value) and "no space left" in str(caught.value)
    assert sorted(p.name for p in out.iterdir()) == []  # no 0-byte bench.json, no temporary left


def test_docs_errors_table_lists_the_serving_cases():
    text = (Path(__file__).resolve().parents[1] / "docs" / "ERRORS.md").read_text()
    assert "| input | what the user sees | what was kept |" in text
    for case in (
        "--stop-policy fixed:-1",
        "--temperature -1",
        "--dtype fp16",
        "Ctrl-C",
        "bench export --drafter TARGET",
        "bench.json",
    ):
        assert case in text, case
    json.dumps(text)


def test_bench_modes_are_explicit_and_each_help_names_only_its_flags(capsys):
    from draftsmith.cli import build_parser

    parser = build_parser("bench")
    for mode, own, foreign in (
        ("export", "--drafter", "--filter"),
        ("diffusion", "--filter", "--drafter"),
        ("reward", "--grid", "--sweep-k"),
        ("controller", "--controller", "--engine-parity"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", mode, "--help"])
        text = capsys.readouterr().out
        assert own in text and foreign not in text, (mode, text)
    assert parser.parse_args(["bench", "diffusion", "--target", "T"]).bench_mode == "diffusion"
    # a line without a mode word still runs as before, its mode read off its flags (and named in a
    # note)
    legacy = parser.parse_args(["bench", "--target", "T", "--filter", "F"])
    assert legacy.bench_mode == "diffusion" and "draftsmith bench diffusion" in legacy.mode_note
    assert parser.parse_args(["bench", "--drafter", "X"]).bench_mode == "export"
    assert parser.parse_args(["bench", "--prompts", "embedded:heldout"]).bench_mode == "reward"
    line = refused(capsys, ["bench", "controller", "--controller", "C", "--engine-parity"])
    assert "--engine-parity belongs to `draftsmith bench export`" in line
