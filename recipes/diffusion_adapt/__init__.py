"""The diffusion adaptation recipe: its objective and build in objective.py."""
