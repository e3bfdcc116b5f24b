"""What a curve trained from a feature cache is billed beyond the drafter's own steps: the target's
pass that wrote the cache, pro rata over the first epoch (so a cached curve and an online one
compare at equal CPU-hours).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftsmith.common.errors import DraftsmithError


class CacheBillError(DraftsmithError, ValueError):
    """``data.features`` names a folder that is not a feature cache."""


def feature_cache_bill(overrides: Sequence[str]) -> dict[str, Any] | None:
    """What training from a feature cache (``data.features=DIR`` among ``overrides``) costs beyond
    the drafter's own
    steps: the CPU seconds the target took to write the cache and the non-padding training tokens it
    holds (None when the curve trains online). A curve is billed that build pro rata over its first
    epoch, so that a cached curve and an online one compare at equal CPU-hours; a value the cache
    did not record is None."""
    from draftsmith.common.cache_costs import MANIFEST, training_bill

    spec = next(
        (
            o.split("=", 1)[1]
            for o in overrides
            if o.lstrip("+").split("=", 1)[0] == "data.features"
        ),
        None,
    )
    if spec in (None, "", "null", "None"):
        return None
    bill = training_bill(Path(spec))
    if bill is None:
        raise CacheBillError(
            f"data.features={spec}: no {MANIFEST} there; build it first with `draftsmith "
            "cache-features recipe=... --out DIR`"
        )
    return bill


def billed_cache_seconds(bill: dict[str, Any] | None, tokens: int | None) -> float | None:
    """The share of the cache's build a curve has used after ``tokens`` training tokens: all of it
    once an epoch is done, in proportion before (0 without a cache; None when the cache did not
    record its cost)."""
    if bill is None:
        return 0.0
    if bill["cpu_seconds"] is None or not bill["train_tokens"]:
        return None
    return bill["cpu_seconds"] * min(1.0, (tokens or 0) / bill["train_tokens"])
