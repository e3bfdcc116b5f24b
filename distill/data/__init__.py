"""Training data: conversations from files or the embedded dump, token ids with assistant-only loss
masks, the tokenised-sample cache and data module, the draft vocabulary, preference pairs and
diffusion trajectories.
"""
