"""The EAGLE-3 recipe: its objective and build in objective.py."""
