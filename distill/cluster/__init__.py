"""Cluster training: Lightning strategy presets, preemption and elastic resumes, the memory model of
each preset."""
