"""``draftsmith calibrate``: how well a SpecDec++ acceptance head's probabilities match real
acceptance.

Held-out drafts come from real speculative decoding of the given prompts: the export's base drafter
drafts chains of a fixed depth (so every depth is scored, not only those the learned rule reaches),
the head predicts P(accept | earlier tokens accepted) for each drafted token from its drafter state,
and the verifier decides. A token counts as an outcome only when every token before it on its chain
was accepted (the head's conditional), with label 1 if it was accepted itself. Outputs:
``calibration.json`` (expected calibration error over equal-width bins, per-bin counts and means,
Brier score, per-depth ECE) and ``reliability.png`` (reliability diagram + histogram).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import InputError
from draftsmith.controllers.acceptance import AcceptanceHead, base_export_dir
from draftsmith.runtime.acceptance.stop_policies import StopContext
from draftsmith.runtime.drafting.base import ProposerWrapper, StepContext
from draftsmith.runtime.drafting.tree import DraftTree


@dataclass
class ScoringStop:
    """Draft exactly ``max_depth`` tokens and record the head's P(accept) of each one it sees
    (depth, prob)."""

    head: torch.nn.Module
    max_depth: int
    seen: list[tuple[int, float]] = field(default_factory=list)

    def should_stop(self, ctx: StopContext) -> bool:
        """Score the token, never stop early."""
        with torch.no_grad():
            p_reject = float(torch.sigmoid(self.head(ctx.state).reshape(-1)[0]))
        self.seen.append((ctx.depth, 1.0 - p_reject))
        return ctx.depth >= self.max_depth


class OutcomeRecorder(ProposerWrapper):
    """Wraps a chain proposer: pairs each step's head predictions with what the verifier
    accepted."""

    def __init__(self, base: Any, policy: ScoringStop) -> None:
        super().__init__(base)
        self.base, self.policy = base, policy
        self.records: list[
            tuple[int, float, int]
        ] = []  # (depth, predicted P(accept), accepted 0/1)
        self._step: list[tuple[int, float]] = []

    def begin(self, ctx: StepContext) -> None:
        self.base.begin(ctx)

    def propose(self, ctx: StepContext) -> DraftTree:
        self.policy.seen = []
        tree = self.base.propose(ctx)
        self._step = list(self.policy.seen)
        return tree

    def accept(self, ctx: StepContext) -> None:
        accepted = ctx.acceptance.num_accepted
        for depth, prob in self._step:
            # every earlier token accepted: an outcome of the head's conditional
            if depth <= accepted + 1:
                self.records.append((depth, prob, int(depth <= accepted)))
        self.base.accept(ctx)


def reliability(pred: torch.Tensor, label: torch.Tensor, bins: int = 10) -> dict[str, Any]:
    """Equal-width reliability bins over [0, 1]: ECE = sum_b (n_b / N) |mean label_b - mean pred_b|,
    plus Brier."""
    if pred.numel() == 0:
        raise InputError("no scored drafts: use more prompts or more new tokens")
    idx = (pred * bins).long().clamp(0, bins - 1)  # [N] bin of each prediction
    rows, ece = [], 0.0
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        mean_p = float(pred[sel].mean()) if n else None
        freq = float(label[sel].float().mean()) if n else None
        if n:
            ece += n / pred.numel() * abs(freq - mean_p)
        rows.append(
            {
                "lo": b / bins,
                "hi": (b + 1) / bins,
                "count": n,
                "mean_predicted": mean_p,
                "observed": freq,
            }
        )
    brier = float(((pred - label.float()) ** 2).mean())
    return {
        "ece": ece,
        "brier": brier,
        "count": int(pred.numel()),
        "mean_predicted": float(pred.mean()),
        "observed_accept_rate": float(label.float().mean()),
        "bins": rows,
    }


def plot_reliability(report: dict[str, Any], path: Path) -> None:
    """Reliability diagram (observed vs predicted per bin, the diagonal) above a histogram of
    predictions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = [b for b in report["bins"] if b["count"]]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    top.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    top.plot(
        [b["mean_predicted"] for b in bins],
        [b["observed"] for b in bins],
        "o-",
        label="acceptance head",
    )
    top.set_ylabel("observed acceptance")
    top.set_title(f"SpecDec++ head: ECE {report['ece']:.3f} over {report['count']} drafts")
    top.legend(loc="upper left")
    edges = [b["lo"] for b in report["bins"]]
    bottom.bar(
        edges, [b["count"] for b in report["bins"]], width=1 / len(report["bins"]), align="edge"
    )
    bottom.set_xlabel("predicted P(accept | earlier accepted)")
    bottom.set_ylabel("drafts")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def calibrate_decoder(
    decoder_factory: Any,
    proposer: Any,
    head: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    depth: int,
    bins: int = 10,
    eos_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Score ``head`` on the drafts of ``proposer`` (a chain proposer) over ``prompts``;
    ``decoder_factory(p)`` builds a SpeculativeDecoder around the recording proposer ``p``. Returns
    the reliability report.
    """
    policy = ScoringStop(head, depth)
    recorder = OutcomeRecorder(proposer, policy)
    decoder = decoder_factory(recorder)
    decoder.stop_policy = policy
    for prompt in prompts:
        decoder.generate(prompt, max_new_tokens, eos_ids, generator=generator)
    depths = torch.tensor([r[0] for r in recorder.records], dtype=torch.long)
    pred = torch.tensor([r[1] for r in recorder.records])
    label = torch.tensor([r[2] for r in recorder.records])
    report = reliability(pred, label, bins)
    report["by_depth"] = {
        int(d): {
            "count": int((depths == d).sum()),
            "ece": reliability(pred[depths == d], label[depths == d], bins)["ece"],
        }
        for d in depths.unique().tolist()
    }
    return report


def calibrate(
    drafter: str,
    prompts: str,
    out: str,
    target: str | None = None,
    num_prompts: int | None = None,
    max_new_tokens: int = 128,
    depth: int | None = None,
    temperature: float = 0.0,
    bins: int = 10,
    dtype: str = "fp32",
    seed: int = 0,
) -> dict[str, Any]:
    """``draftsmith calibrate``: load the SpecDec++ export and its drafter on the target, decode
    ``prompts`` (mtbench or a .jsonl), write ``OUT/calibration.json`` and ``OUT/reliability.png``;
    returns the report."""
    from draftsmith.bench.prompts import load_prompts
    from draftsmith.runtime.acceptance.choice import choose_verifier
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.serving import load_runtime

    config = _specdecpp_config(drafter)
    head, head_config = AcceptanceHead.from_export(drafter)
    base = base_export_dir(head_config)
    runtime = load_runtime(None, target or config["target"]["name_or_path"], dtype=dtype)
    stop = (config.get("inference") or {}).get("stop_policy") or {}
    depth = int(depth or stop.get("max_depth", 6))
    proposer = _base_proposer(base, runtime.model, depth, temperature)
    verifier, _ = choose_verifier("auto", temperature, "auto", None)
    head = head.to(runtime.model.lm_head_weight.device)
    encoded = load_prompts(prompts, runtime.tokenizer, num_prompts)
    report = calibrate_decoder(
        lambda p: SpeculativeDecoder(runtime.model, p, verifier),
        proposer,
        head,
        encoded,
        max_new_tokens,
        depth + 1,
        bins,
        runtime.eos_ids,
        torch.Generator().manual_seed(seed),
    )
    report.update(
        {
            "export": str(drafter),
            "base_export": str(base),
            "prompts": prompts,
            "num_prompts": len(encoded),
            "temperature": temperature,
            "depth": depth,
        }
    )
    _write_report(report, Path(out))
    return report


def _specdecpp_config(drafter: str) -> dict[str, Any]:
    """The export's config; anything but a SpecDec++ export is refused in one line."""
    from draftsmith.export.format import read_config

    config = read_config(drafter)
    if config.get("method") != "specdecpp":
        raise InputError(
            f"{drafter} is a {config.get('method')!r} export; calibrate scores a SpecDec++"
            " acceptance head (method 'specdecpp', from `python train.py recipe=specdecpp"
            " drafter=EXPORT_DIR`)"
        )
    return config


def _base_proposer(base: Path, model: Any, depth: int, temperature: float) -> Any:
    """The base export's proposer, drafting ``depth + 1`` tokens its own way."""
    from draftsmith.runtime.drafting.registry import build_proposer, chain_options

    options = {"temperature": temperature if temperature > 0 else 0.0}
    options.update(chain_options(base, depth + 1))
    return build_proposer(base, model, **options)


def _write_report(report: dict[str, Any], folder: Path) -> None:
    """``calibration.json`` and ``reliability.png`` in ``folder``, each written beside, then renamed
    in."""
    from draftsmith.common.atomic_folder import write_file

    write_file(folder / "calibration.json", json.dumps(report, indent=2) + "\n")
    write_file(folder / "reliability.png", lambda tmp: plot_reliability(report, tmp))
