"""The Kangaroo recipe: its objective and build in objective.py."""
