"""Decoding loops: autoregressive, speculative (room for parallel/diffusion loops), and their
metrics."""
