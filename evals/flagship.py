"""The flagship drafter kept in the repository (``flagship/<name>/``) and the rule that replaces it.

The folder is an ordinary draftsmith export whose floating weights are stored in bf16 (the loaders
upcast them into the runtime's dtype; half the bytes, under ~25 MB for EAGLE-3 on SmolLM2-135M) plus
``RECORD.json`` (how it was
trained: hardware, tokens, wall time, CPU-hours, commands; its held-out acceptance by position; its
served speed) and a short ``README.md``. ``draftsmith flagship ship RUN_OR_EXPORT`` (:func:`ship`)
measures a candidate's held-out acceptance (MT-Bench and HumanEval prompts, 8 x 128, greedy, fp32:
the same on every machine) on the very bytes it would ship, and replaces the shipped folder only
when the mean first-position acceptance rises by ``MIN_GAIN`` or
more: one copy of the weights per real gain, not per sitting. It prints the comparison either way.

Every stage resumes and refuses damage in one line: the candidate and the shipped folder are read
whole before any work (a truncated file is named); the bf16 copy and each evaluation are kept under
``WORK`` (atomic writes), so a re-run after Ctrl-C, SIGTERM or ``kill -9`` picks up where it
stopped; the shipped folder is swapped in atomically
(:func:`draftsmith.common.atomic_folder.write_folder`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.atomic_folder import OutputKind, write_file, write_folder
from draftsmith.common.errors import DraftsmithError
from draftsmith.evals.flagship_record import readme, record
from draftsmith.evals.learning_curve import EvalSettings
from draftsmith.export.format import CONFIG_FILE, WEIGHTS_FILE, ExportError, read_export
from draftsmith.export.target_check import IDENTITY_FIELDS

NAME = "eagle3-smollm2-135m"
FLAGSHIP_DIR = Path(__file__).resolve().parents[1] / "flagship" / NAME
RECORD_FILE, README_FILE = "RECORD.json", "README.md"
# held-out first-position acceptance a candidate must add to replace the shipped drafter
MIN_GAIN = 0.02
SETTINGS = EvalSettings(
    prompt_sets=("mtbench", "humaneval"), prompts=8, max_new_tokens=128, dtype="fp32"
)
FLAGSHIP = OutputKind(
    "flagship drafter",
    lambda f: (f / RECORD_FILE).is_file(),
    (CONFIG_FILE, WEIGHTS_FILE, RECORD_FILE, README_FILE),
)
STAGED = OutputKind(
    "staged flagship candidate", lambda f: (f / CONFIG_FILE).is_file(), (CONFIG_FILE, WEIGHTS_FILE)
)


class FlagshipError(DraftsmithError, ValueError):
    """A candidate or shipped drafter that cannot be compared (damaged, another method or target, no
    export)."""


def candidate_export(path: str | Path) -> tuple[Path, Path | None]:
    """(export folder, run folder or None) of ``path``: a run folder (its ``export/``) or an export
    folder."""
    path = Path(path)
    if (path / "export" / CONFIG_FILE).is_file():
        return path / "export", path
    if (path / CONFIG_FILE).is_file():
        return path, None
    raise FlagshipError(
        f"{path} is neither a run folder with export/ nor an export folder (no {CONFIG_FILE}); "
        "pass what training wrote"
    )


def read_whole(export: Path, what: str, fix: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An export's config and weights, read whole: a missing, damaged or partial file is one
    line."""
    try:
        return read_export(export)
    except ExportError as err:
        raise FlagshipError(f"{what} {export}: {err}; {fix}") from None


def read_shipped(dest: Path) -> dict[str, Any] | None:
    """The shipped drafter's record (weights and config read whole too), or None when nothing is
    shipped yet."""
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        return None
    fix = f"restore it (git checkout -- {dest}) before shipping; nothing was replaced"
    read_whole(dest, "the shipped flagship", fix)
    try:
        return json.loads((dest / RECORD_FILE).read_text())
    except (OSError, ValueError) as err:
        raise FlagshipError(
            f"the shipped flagship's {dest / RECORD_FILE} is damaged ({err}); {fix}"
        ) from None


def same_drafter_kind(config: dict[str, Any], shipped: dict[str, Any] | None) -> None:
    """Refuse a candidate of another method, or for another target, than the shipped one."""
    if shipped is None:
        return
    if config["method"] != shipped["method"]:
        raise FlagshipError(
            f"the candidate is a {config['method']} export and the flagship a {shipped['method']} "
            "one: ship it elsewhere (--dest)"
        )
    mine, theirs = config.get("target") or {}, shipped.get("target") or {}
    differ = [
        k for k in IDENTITY_FIELDS if theirs.get(k) is not None and mine.get(k) != theirs.get(k)
    ]
    if differ:
        raise FlagshipError(
            "the candidate was trained for another target than the flagship (differs in "
            f"{', '.join(differ)}): ship it elsewhere (--dest)"
        )


def stage(
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    lineage: dict[str, Any] | None,
    out: Path,
) -> Path:
    """The folder that would ship: the export's config (its ``training.lineage`` filled in) and its
    weights with every floating tensor in bf16, written atomically; kept, so a re-run does not
    convert again."""
    if (out / CONFIG_FILE).is_file() and (out / WEIGHTS_FILE).is_file():
        return out
    from safetensors.torch import save_file

    config = json.loads(
        json.dumps(config)
    )  # a plain copy (the architecture block is a dict subclass)
    if lineage is not None:
        config.setdefault("training", {})["lineage"] = lineage
    stored = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
        for k, v in weights.items()
    }

    def fill(tmp: Path) -> None:
        save_file(
            stored,
            str(tmp / WEIGHTS_FILE),
            metadata={"format": "pt", "method": str(config["method"]), "part": "model"},
        )
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    return write_folder(out, fill, STAGED)


def evaluated(
    export: Path, path: Path, settings: EvalSettings, evaluate: Callable[..., Any]
) -> dict[str, Any]:
    """The held-out evaluation of ``export``, kept at ``path`` (a damaged one is refused in one
    line)."""
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError as err:
            raise FlagshipError(
                f"{path} is damaged ({err}); delete it and re-run to evaluate again"
            ) from None
    result, _ = evaluate(str(export), settings, measure=False)
    write_file(path, json.dumps(result, indent=1) + "\n")
    return result


def mean_first(evaluation: dict[str, Any], settings: EvalSettings) -> float:
    """Mean first-position acceptance over the prompt sets."""
    return sum(evaluation[s]["first_position_acceptance"] for s in settings.prompt_sets) / len(
        settings.prompt_sets
    )


def fingerprint(export: Path) -> str:
    """sha256 of an export's config and weights (names its work folder)."""
    digest = hashlib.sha256((export / CONFIG_FILE).read_bytes())
    with open(export / WEIGHTS_FILE, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def shipped_evaluation(
    dest: Path,
    shipped: dict[str, Any] | None,
    settings: EvalSettings,
    work: Path,
    evaluate: Callable[..., Any],
) -> dict[str, Any] | None:
    """The shipped drafter's held-out evaluation: its record's when taken with ``settings``, else
    measured now."""
    if shipped is None:
        return None
    held = shipped.get("held_out") or {}
    if held.get("settings") == json.loads(json.dumps(asdict(settings))):
        return held["sets"]
    return evaluated(dest, work / f"shipped-{fingerprint(dest)[:16]}.json", settings, evaluate)


def comparison(
    candidate: dict[str, Any],
    current: dict[str, Any] | None,
    settings: EvalSettings,
    min_gain: float,
) -> dict[str, Any]:
    """Per set and on the mean: the shipped and the candidate first-position acceptance, the gain,
    the verdict."""
    new = mean_first(candidate, settings)
    old = None if current is None else mean_first(current, settings)
    sets = {
        s: {
            "shipped": None if current is None else current[s]["first_position_acceptance"],
            "candidate": candidate[s]["first_position_acceptance"],
        }
        for s in settings.prompt_sets
    }
    gain = None if old is None else new - old
    return {
        "sets": sets,
        "shipped_mean": old,
        "candidate_mean": new,
        "gain": gain,
        "min_gain": min_gain,
        "ships": old is None or gain >= min_gain - 1e-12,
    }


def comparison_lines(cmp: dict[str, Any]) -> list[str]:
    """The comparison as a markdown table and a verdict line."""

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    lines = ["| prompts | shipped | candidate |", "|---|---|---|"]
    lines += [
        f"| {s} | {num(v['shipped'])} | {num(v['candidate'])} |" for s, v in cmp["sets"].items()
    ]
    lines.append(
        f"| mean first-position | {num(cmp['shipped_mean'])} | {num(cmp['candidate_mean'])} |"
    )
    if cmp["shipped_mean"] is None:
        verdict = "nothing is shipped yet: the candidate ships"
    elif cmp["ships"]:
        verdict = (
            f"gain {cmp['gain']:+.3f} >= {cmp['min_gain']}: the candidate replaces the flagship"
        )
    else:
        verdict = f"gain {cmp['gain']:+.3f} < {cmp['min_gain']}: the flagship stays as it is"
    return [*lines, "", verdict]


def ship(
    candidate: str | Path,
    dest: str | Path = FLAGSHIP_DIR,
    work_root: str | Path | None = None,
    settings: EvalSettings = SETTINGS,
    min_gain: float = MIN_GAIN,
    lineage: dict[str, Any] | None = None,
    evaluate: Callable[..., Any] | None = None,
    served: Callable[[Path, Path], dict | None] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure ``candidate`` (a run or export folder) and replace the drafter shipped at ``dest``
    when its held-out first-position acceptance beats the shipped one's by ``min_gain``; returns the
    comparison (``shipped``: whether it replaced the flagship). ``lineage``: the candidate's record
    when its export lacks one (from its run folder);
    ``served``: measures the staged folder's speed for the record (None: not measured)."""
    from draftsmith import assets
    from draftsmith.evals.learning_curve import evaluate_export

    evaluate = evaluate or evaluate_export
    export, _ = candidate_export(candidate)
    config, weights = read_whole(export, "the candidate", "re-export it")
    dest = Path(dest)
    shipped = read_shipped(dest)
    same_drafter_kind(config, None if shipped is None else read_export(dest)[0])
    work = Path(work_root or assets.cache_dir() / "ship") / fingerprint(export)[:16]
    staged = stage(
        config, weights, lineage or (config.get("training") or {}).get("lineage"), work / "staged"
    )
    say(
        f"held-out acceptance of the candidate (bf16-stored, served {settings.dtype}; kept in"
        f" {work})"
    )
    result = evaluated(staged, work / "eval.json", settings, evaluate)
    current = shipped_evaluation(dest, shipped, settings, work, evaluate)
    cmp = comparison(result, current, settings, min_gain)
    for line in comparison_lines(cmp):
        say(line)
    if cmp["ships"]:
        speed = served(staged, work) if served is not None else None
        keep = record(
            read_export(staged)[0],
            staged,
            result,
            settings,
            cmp,
            speed,
            source=str(export),
            shipped_at=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()),
        )

        def fill(tmp: Path) -> None:
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                (tmp / name).write_bytes((staged / name).read_bytes())
            (tmp / RECORD_FILE).write_text(json.dumps(keep, indent=1) + "\n")
            (tmp / README_FILE).write_text(readme(keep))

        write_folder(dest, fill, FLAGSHIP)
        say(f"shipped to {dest} ({(dest / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB of weights)")
    return {**cmp, "shipped": cmp["ships"], "dest": str(dest), "work": str(work)}
