"""The DFlash drafter's architecture (:class:`DFlashConfig`, checked on construction) and its
default target taps (:func:`default_target_layers`); the drafter itself is drafters/dflash.py.

``target_layers`` follow our tap convention: indices into HF's ``hidden_states`` tuple (0 = the
embedding output, ``i`` = the input of decoder layer ``i``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def default_target_layers(num_layers: int, num_taps: int = 3) -> tuple[int, ...]:
    """Taps spread over depth as z-lab's ``build_target_layer_ids`` (layer outputs 1 .. L-3), in our
    convention (+1: HF ``hidden_states`` indices, so 2 .. L-2). SmolLM2-135M (L=30), 3 taps: (2, 15,
    28). A target too shallow for ``num_taps`` distinct taps raises ValueError."""
    start, end = 1, num_layers - 3
    if num_taps == 1:
        taps = (num_layers // 2 + 1,)
    else:
        taps = tuple(
            int(round(start + i * (end - start) / (num_taps - 1))) + 1 for i in range(num_taps)
        )
    if len(set(taps)) != num_taps or min(taps) < 0 or max(taps) > num_layers - 1:
        raise ValueError(
            f"a {num_layers}-layer target has no {num_taps} distinct default DFlash taps; set "
            f"drafter.target_layers explicitly, e.g. [{', '.join(map(str, range(1, num_layers)))}]"
        )
    return taps


@dataclass
class DFlashConfig:
    """Architecture of a DFlash drafter. ``target_layers``: HF ``hidden_states`` indices (0 =
    embeddings)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    target_hidden_size: int
    block_size: int
    mask_token_id: int
    target_layers: tuple[int, ...] = field(default_factory=tuple)
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    confidence_head: bool = False
    markov_head: bool = False
    markov_rank: int = 32

    def __post_init__(self) -> None:
        self.target_layers = tuple(int(i) for i in self.target_layers)
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        problems = [
            (
                self.block_size < 2,
                (
                    "block_size must be >= 2 (slot 0 holds the verified token, slots 1.. the"
                    f" drafts), got {self.block_size}"
                ),
            ),
            (not self.target_layers, "target_layers is empty: give the target layers to tap"),
            (
                min(self.target_layers, default=0) < 0,
                f"target_layers {list(self.target_layers)} has negative indices",
            ),
            (self.num_layers < 1, f"num_layers must be >= 1, got {self.num_layers}"),
            (
                not 0 <= self.mask_token_id < self.vocab_size,
                (
                    f"mask_token_id {self.mask_token_id} is outside the vocabulary"
                    f" 0..{self.vocab_size - 1}"
                ),
            ),
            (
                self.hidden_size != self.target_hidden_size,
                (
                    f"hidden_size {self.hidden_size} != target_hidden_size"
                    f" {self.target_hidden_size}: DFlash shares the target's embedding and LM head"
                ),
            ),
            (
                self.num_heads % self.num_kv_heads != 0,
                (
                    f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads"
                    f" ({self.num_kv_heads})"
                ),
            ),
            (self.head_dim % 2 != 0, f"head_dim must be even for RoPE, got {self.head_dim}"),
            (self.markov_rank < 1, f"markov_rank must be >= 1, got {self.markov_rank}"),
        ]
        for bad, message in problems:
            if bad:
                raise ValueError(message)

    @property
    def num_attention_heads(self) -> int:
        """HF-style alias of ``num_heads``."""
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        """HF-style alias of ``num_kv_heads``."""
        return self.num_kv_heads
