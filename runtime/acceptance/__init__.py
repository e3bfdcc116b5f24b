"""Acceptance: verifiers, stop policies, and the choice of both from an export and flags."""
