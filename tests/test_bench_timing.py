"""The bench's timing: interleaved decoders share a machine's drift, the speedup's interval over
prompts, and HF generate capped at the context as the runtime is (so the lossless comparison
compares outputs of one length)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_interleaved_timing_rotates_the_order_and_shares_drift(monkeypatch):
    """Prompt i runs the decoders in an order rotated by i; a machine that slows down over the bench
    slows both decoders alike (sequential timing charged all of it to the decoder timed second)."""
    from draftsmith.bench import timing

    clock = {"now": 0.0, "calls": 0}
    order: list[str] = []

    def slowing_decoder(name: str):
        def decode(prompt: list[int]) -> list[int]:
            order.append(name)
            clock["calls"] += 1
            # each call takes longer than the last: drift
            clock["now"] += 1.0 + 0.1 * clock["calls"]
            return list(prompt)

        return decode

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    timed = timing.time_interleaved(
        {"a": slowing_decoder("a"), "b": slowing_decoder("b")}, [[1, 2]] * 4
    )
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert timed["a"]["seconds"] == pytest.approx(timed["b"]["seconds"])
    assert timed["a"]["outputs"] == [[1, 2]] * 4 and timed["b"]["tokens"] == 8
    with pytest.raises(ValueError, match="no prompts"):
        timing.time_interleaved({"a": slowing_decoder("a")}, [])


def _timer(rows: list[tuple[int, float]]) -> dict:
    return {"per_prompt": [{"tokens": t, "seconds": s} for t, s in rows]}


def test_speedup_ci_brackets_the_ratio_and_collapses_when_every_prompt_agrees():
    from draftsmith.bench.timing import speedup_ci

    base = _timer([(100, 1.0), (50, 0.5), (80, 1.0)])
    twice = _timer([(100, 0.5), (50, 0.25), (80, 0.5)])  # every prompt exactly 2x faster
    lo, hi = speedup_ci(base, twice)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    noisy = _timer(
        [(100, 0.9), (50, 0.6), (80, 1.0)]
    )  # per prompt 1.11x, 0.83x, 0.8x of base's rate
    lo, hi = speedup_ci(base, noisy)
    assert 0.8 - 1e-9 <= lo < hi <= 1.0 / 0.9 + 1e-9
    with pytest.raises(ValueError, match="same prompts"):
        speedup_ci(base, _timer([(100, 1.0)]))
    assert speedup_ci(_timer([(100, 1.0)]), _timer([(100, 0.5)])) == (
        None,
        None,
    )  # one prompt: no interval


def test_hf_generate_stops_at_the_context_as_the_runtime_does(tiny_target_dir):
    """Past the model's context the runtime caps ``max_new_tokens``; the HF baseline is capped
    alike, so the bench's lossless comparison compares outputs of one length (HF would otherwise run
    on past max_position_embeddings).
    """
    from draftsmith.bench.timing import compare_outputs, time_hf_generate
    from draftsmith.runtime.decoding.autoregressive import generate_ar
    from draftsmith.runtime.decoding.prompt_limits import ContextCapWarning
    from draftsmith.runtime.target.loading import load_decoder

    prompt = [5, 9, 11, 7]
    with pytest.warns(ContextCapWarning, match="context of 512 positions"):
        hf = time_hf_generate(tiny_target_dir, [prompt], 10**6)
        ours = generate_ar(load_decoder(tiny_target_dir), prompt, 10**6)
    assert (
        len(hf["outputs"][0]) <= 512 - len(prompt)
        and compare_outputs(hf["outputs"], [ours])["all_identical"]
    )
