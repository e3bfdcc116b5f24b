"""The toy's files are a method's files for a copy of the repository (tests/toy_method/__init__.py
places them); its own test runs there, never from here."""

collect_ignore = ["tests"]
