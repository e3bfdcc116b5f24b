"""Evaluations that score quality rather than speed: acceptance-head calibration, the reward
evaluation of adaptive-temperature layers, and the block-diffusion (Learn2PD) evaluation."""
