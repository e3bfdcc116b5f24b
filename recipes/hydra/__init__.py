"""The Hydra and Hydra++ recipe: its objective and build in objective.py."""
