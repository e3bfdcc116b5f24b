"""The training engine: the one LightningModule, the objective contract, the trainer, its callbacks
(progress, checkpoints, exports, resume checks) and the training-throughput benchmark."""
