"""The DFlash recipe: its objective and build in objective.py."""
