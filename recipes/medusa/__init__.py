"""The Medusa-1 recipe: its objective and build in objective.py."""
