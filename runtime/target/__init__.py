"""The target side: lean decoder, HF fallback, weights, KV cache, linear backends."""
