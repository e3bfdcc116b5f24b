"""Acceptance over long outputs (``bench --window W``, ``--long``): tau by output window.

The aggregation is checked exactly on hand-built step records; the bench on the tiny target (64 new
tokens, window
16) must write the windows into bench.json and bench.md and draw them beside the acceptance curve in
    the PNG.
"""

from __future__ import annotations

import json
import struct
from argparse import Namespace

import pytest

from draftsmith.bench import windows
from draftsmith.bench.report import write_outputs
from draftsmith.bench.run import run_bench
from draftsmith.cli import build_parser
from draftsmith.common.chat import encode_chat
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.serving import load_runtime

pytestmark = pytest.mark.unit


def png_width(path) -> int:
    """Pixel width from a PNG's IHDR chunk (bytes 16-20, big-endian)."""
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_step_starts_count_the_prefill_token_and_each_bonus():
    # position 0 is the prefill's token; a step emits its accepted drafts + one bonus token
    assert windows.step_starts([3, 0, 2, 1, 4]) == [1, 5, 6, 9, 11]
    assert windows.step_starts([]) == []


def test_window_aggregation_is_exact_on_a_hand_built_record():
    a = [3, 0, 2, 1, 4]  # starts 1, 5, 6, 9, 11 -> windows of 4: [1], [5, 6], [9, 11]
    b = [0, 0, 0, 0, 0, 0]  # starts 1..6 -> [1, 2, 3], [4, 5, 6]
    got = windows.tau_by_window([a, b], window=4, max_new_tokens=16)
    assert got == [
        {"start": 0, "end": 4, "tau": (4 + 1 + 1 + 1) / 4, "forwards": 4, "prompts": 2},
        {"start": 4, "end": 8, "tau": (1 + 3 + 1 + 1 + 1) / 5, "forwards": 5, "prompts": 2},
        {
            "start": 8,
            "end": 12,
            "tau": (2 + 5) / 2,
            "forwards": 2,
            "prompts": 1,
        },  # b stopped (EOS) before 8
    ]
    # every step counts once: the windows pool back to the run's tau
    assert sum(w["forwards"] for w in got) == len(a) + len(b)
    pooled = sum(w["tau"] * w["forwards"] for w in got) / sum(w["forwards"] for w in got)
    assert pooled == pytest.approx(metrics.tau(a + b))
    # the last window ends at max_new_tokens when that cuts it
    assert windows.tau_by_window([a], window=4, max_new_tokens=10)[-1] == {
        "start": 8,
        "end": 10,
        "tau": 3.5,
        "forwards": 2,
        "prompts": 1,
    }
    assert windows.tau_by_window([], 4, 16) == []
    with pytest.raises(ValueError, match="window must be >= 1"):
        windows.tau_by_window([a], window=0, max_new_tokens=16)


def test_the_long_preset_fills_only_what_was_not_given():
    args = build_parser("bench").parse_args(["bench", "--drafter", "x", "--long"])
    windows.apply_preset(args)
    assert (args.num_prompts, args.max_new_tokens, args.window) == (2, 2048, 256)
    args = build_parser("bench").parse_args(
        ["bench", "--drafter", "x", "--long", "--max-new-tokens", "512", "--window", "64"]
    )
    windows.apply_preset(args)
    assert (args.num_prompts, args.max_new_tokens, args.window) == (2, 512, 64)
    plain = Namespace(long=False, num_prompts=None, max_new_tokens=None, window=None)
    windows.apply_preset(plain)
    assert (plain.num_prompts, plain.max_new_tokens, plain.window) == (
        None,
        128,
        windows.DEFAULT_WINDOW,
    )


def test_a_window_below_one_is_refused_before_anything_loads(capsys):
    from draftsmith.cli import main

    assert main(["bench", "--drafter", "nowhere", "--window", "0"]) == 2
    assert "--window must be >= 1, got 0" in capsys.readouterr().err


def test_the_plot_draws_one_line_per_drafter_at_window_middles():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    series = {
        "eagle3": [
            {"start": 0, "end": 16, "tau": 2.0, "forwards": 5, "prompts": 1},
            {"start": 16, "end": 32, "tau": 1.5, "forwards": 7, "prompts": 1},
        ],
        "dflash": [{"start": 0, "end": 16, "tau": 3.0, "forwards": 4, "prompts": 1}],
    }
    windows.plot_windows(ax, series)
    lines = [ln for ln in ax.get_lines() if ln.get_label() in series]
    assert [ln.get_label() for ln in lines] == ["eagle3", "dflash"]
    assert list(lines[0].get_xdata()) == [8.0, 24.0] and list(lines[0].get_ydata()) == [2.0, 1.5]
    plt.close(fig)


def test_bench_writes_the_windows_and_the_png_panel(medusa_export, tmp_path):
    rt = load_runtime(str(medusa_export), None, "fp32")
    prompts = [
        encode_chat(rt.tokenizer, text)
        for text in ("hello world what is the answer ?", "please explain code")
    ]
    result = run_bench(rt, prompts, max_new_tokens=64, skip_hf=True, window=16)
    got = result["tau_by_window"]
    assert result["tau_window_tokens"] == 16 and got
    assert all(set(w) == {"start", "end", "tau", "forwards", "prompts"} for w in got)
    assert [w["start"] for w in got] == [16 * i for i in range(len(got))] and got[-1]["end"] <= 64
    pooled = sum(w["tau"] * w["forwards"] for w in got) / sum(w["forwards"] for w in got)
    assert pooled == pytest.approx(result["tau"])  # the windows split the run's own steps
    out = write_outputs(result, tmp_path / "b")
    assert json.loads((out / "bench.json").read_text())["tau_by_window"] == got
    md = (out / "bench.md").read_text()
    assert "tau by output window (16 tokens" in md and f"0-16: {got[0]['tau']:.2f}" in md
    two_panels = png_width(out / "acceptance.png")
    plain = write_outputs(
        {**result, "tau_by_window": None}, tmp_path / "plain"
    )  # plain decoding: no tau
    assert two_panels > 1.8 * png_width(plain / "acceptance.png")
    assert "n/a (no drafts" in (plain / "bench.md").read_text()
