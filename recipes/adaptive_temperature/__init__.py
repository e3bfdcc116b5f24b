"""The adaptive temperature (LPO) recipe: its objective and build in objective.py."""
