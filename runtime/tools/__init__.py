"""Tools built on the runtime: regenerate (self-distilled training data)."""
