"""The Learn2PD recipe: its objective and build in objective.py."""
