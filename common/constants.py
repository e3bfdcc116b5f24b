"""Strings that cross rooms: written into an export by training (recipes/, distill/) and read back
by serving (runtime/). Both sides import them from here, so a rename cannot break the format on one
side only.
"""

from __future__ import annotations

# ``inference.proposer`` of an EAGLE-family export: the proposer policy the runtime builds by
# default.
EAGLE_TREE_PROPOSER = "eagle_dynamic_tree"  # EAGLE-2's dynamic draft tree
EAGLE_CHAIN_PROPOSER = "eagle_chain"  # one token per drafting step

# ``inference.stop_policy.kind`` of an export; also the CLI spellings ``fixed:K``, ``confidence:T``,
# ``learned:H``.
STOP_FIXED = "fixed"
STOP_CONFIDENCE = "confidence"
STOP_LEARNED = "learned"
STOP_POLICY_KINDS = (STOP_FIXED, STOP_CONFIDENCE, STOP_LEARNED)

# ``kind`` of a weight part / ``target.adapter`` block that is a LoRA adapter on the target
# (Medusa-2).
ADAPTER_LORA = "lora"

__all__ = [
    "ADAPTER_LORA",
    "EAGLE_CHAIN_PROPOSER",
    "EAGLE_TREE_PROPOSER",
    "STOP_CONFIDENCE",
    "STOP_FIXED",
    "STOP_LEARNED",
    "STOP_POLICY_KINDS",
]
