"""Bench: timing, the benchmark run, its report."""
