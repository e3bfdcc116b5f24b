"""The SpecDec++ recipe: its objective and build in objective.py."""
