"""The Medusa-2 recipe: its objective and build in objective.py."""
