"""The frozen target: its forward and feature taps, what a method asks of it, sharding across
devices, and the LoRA adapters Medusa-2 trains on it."""
