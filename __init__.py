"""draftsmith: train speculative-decoding drafters and controllers, export them, prove them in a
runtime."""

__version__ = "0.1.0"
