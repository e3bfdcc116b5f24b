"""Refuse an export used with a target other than the one it was trained for: the ``target`` block
an export records (export/identity.py computes it) compared with the identity of the target given,
field by field, in one line that names each difference.
"""

from __future__ import annotations

from typing import Any

from draftsmith.export.format import TargetMismatchError

IDENTITY_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "fingerprint", "lm_head")
# Added after format_version 1 shipped: exports written before it lack the field, which is then not
# compared.
LATER_IDENTITY_FIELDS = ("lm_head",)


def check_target(
    config: dict[str, Any], identity: dict[str, Any], given: str | None = None
) -> None:
    """Raise ``TargetMismatchError`` if ``identity`` is not the target recorded in ``config``.

    Only the fields ``identity`` carries are compared (a decoder without its tokenizer has no
    ``fingerprint``); fields added to the format later are skipped for exports that predate them.
    ``given`` names the target the user passed (folder or alias) for the message; default:
    ``identity["name_or_path"]``.
    """
    recorded = config.get("target", {})
    adapter = recorded.get("adapter")
    if adapter and (identity.get("adapter") or {}).get("fingerprint") != adapter.get("fingerprint"):
        raise TargetMismatchError(
            f"this {config.get('method')} export changes its target (a trained"
            f" {adapter.get('kind', 'adapter')} {adapter.get('fingerprint', '')[:19]}... ships as"
            " the export's 'adapter' part), but the target given does not carry it; load the"
            " target with the export's adapter applied"
        )
    diffs = [
        f"{k}: export has {recorded.get(k)!r}, target has {identity[k]!r}"
        for k in IDENTITY_FIELDS
        if identity.get(k) is not None
        and recorded.get(k) != identity[k]
        and not (k in LATER_IDENTITY_FIELDS and recorded.get(k) is None)
    ]
    if not diffs:
        return
    want = recorded.get("name_or_path")
    shown = given if given is not None else identity.get("name_or_path")
    if shown is None or str(shown) == str(
        want
    ):  # the identity may carry the export's own name: never print it twice
        other = "the loaded target is a different model"
    else:
        other = f"the given target {str(shown)!r} is a different model"
    raise TargetMismatchError(
        f"this {config.get('method')} drafter was exported for target {want!r}, but {other} ("
        + "; ".join(diffs)
        + "). Use the target it was trained for, or retrain the drafter for this target."
    )
