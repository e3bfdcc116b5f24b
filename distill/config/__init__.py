"""The typed training config (one dataclass per shared group) and the checks run on a composed
config before anything loads."""
