"""Training losses: cross-entropy and its soft and fused forms, acceptance-targeted losses, LPO."""
