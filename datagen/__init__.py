"""Training-data producers: regenerate (self-distilled conversations), rollouts (LPO preference
pairs), trajectories (Learn2PD oracle traces), rewards and the embedded mixed task. Each module owns
its folder format: the writer and the reader (``distill/`` imports the readers)."""
