"""Callbacks of the one LightningModule: the training guards (non-finite, nothing scored, zero
loss), the served-tau probe and the ZeRO-3 device fix-up."""
