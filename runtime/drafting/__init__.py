"""Drafting: the proposer protocol and registry, trees, one file per proposer family."""
