"""Lean Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3, Phi-3; Gemma-2/3) over a static
KV cache, batch 1.

Loads a Hugging Face folder's safetensors directly; q/k/v and gate/up are fused and RoPE tables
precomputed at load. Attention goes through ``draftsmith.kernels.attention.tree_attention`` so a
draft tree is verified in the same forward as plain decoding. In bf16 on x86 CPUs with AVX512-BF16
or AVX2+FMA the whole forward (every layer, the final norm and the head) is one call of the fused
C++ kernel (``draftsmith.kernels.cpu_layer``'s ``TargetStack``; this module's torch path is its
reference; ``forward_layers`` runs its layer ranges one ``decoder_layer`` call per layer).

Numerics follow transformers (RMSNorm in fp32, RoPE in the model dtype, scale ``head_dim**-0.5``);
in fp32 the logits match HF to ~1e-5. Batch size is 1 by design: speculative decoding of one
request.

A model whose layers go beyond the plain Llama layer (sliding windows, Gemma's norms, softcaps,
GELU) is built as :class:`draftsmith.runtime.target.family_decoder.FamilyDecoder`, a subclass chosen
once when it is constructed (``ModelConfig.llama_layer_gap``), so this module's decode step carries
no per-token check for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.runtime.target.cache import KVCache
from draftsmith.runtime.target.execution import ExecutionWeights
from draftsmith.runtime.target.interface import TargetDecoder, TargetSizes, check_head
from draftsmith.runtime.target.layer_range import LayerRangeStep
from draftsmith.runtime.target.layer_weights import (
    canonical_weights,
    checkpoint_prefix,
    checkpoint_tensor,
    fused_layers,
)
from draftsmith.runtime.target.linear_ops import PackedLinear
from draftsmith.runtime.target.model_config import (
    ModelConfig,
    UnsupportedArchitecture,
    rope_inv_freq,
)
from draftsmith.runtime.target.output import TargetOutput
from draftsmith.runtime.target.rows import RowsStep
from draftsmith.runtime.target.weights import WeightsError, load_safetensors

__all__ = ["LeanDecoder", "ModelConfig", "UnsupportedArchitecture", "rope_inv_freq"]


class LeanDecoder(ExecutionWeights, LayerRangeStep, RowsStep, TargetDecoder):
    """Llama-family decoder for batch-1 inference over a :class:`KVCache`, with tree-masked
    multi-token forwards (the :class:`~draftsmith.runtime.target.interface.TargetDecoder`
    interface). Its execution weights are built by :class:`ExecutionWeights`
    (runtime/target/execution.py), its layer loop and layer-range API live in
    :class:`LayerRangeStep` (runtime/target/layer_range.py)."""

    argmax_head = True  # forward(head="argmax") returns each row's argmax without the [T, V] logits

    def __new__(cls, config: ModelConfig | None = None, *args, **kwargs) -> LeanDecoder:
        # A config the plain Llama layer cannot run builds the general-layer subclass: decided once,
        # here.
        if cls is LeanDecoder and config is not None and config.llama_layer_gap is not None:
            from draftsmith.runtime.target.family_decoder import FamilyDecoder

            cls = FamilyDecoder
        return super().__new__(cls)

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        kernel_backend: str = "auto",
        linear_backend: str = "auto",
        compile: bool = False,
    ) -> None:
        """Build from HF-named tensors (``model.layers.{i}.self_attn.q_proj.weight`` ...; the
        ``model.`` prefix is optional). Raises WeightsError naming missing tensors.

        ``kernel_backend`` goes to the attention / KV-compaction kernels ("auto" | "torch" |
        "triton").
        ``linear_backend``: "dense" (F.linear), "mkldnn" (oneDNN-prepacked bf16 weights, CPU only;
        keeps a second copy of the weights), "cpp" (the fused C++ bf16 layer, x86 with AVX512-BF16
        or AVX2+FMA) or "auto" (the fastest that can run on this CPU, see
        ``draftsmith.runtime.target.linear_ops``; ``linear_plan`` records it).
        ``compile``: run the forward through ``torch.compile(dynamic=True)``. Off by default: on the
        2-core CPU it cut the per-step overhead of a 30-layer model from ~3.2 to ~1.9 ms but the
        first call compiled for ~3 min.
        """
        super().__init__()
        weights = canonical_weights(config, weights)  # Phi-3 / Gemma checkpoints under Llama names
        self.config = config
        self.kernel_backend = kernel_backend
        self.linear_backend = linear_backend
        p = checkpoint_prefix(weights)
        self.layers = fused_layers(config, weights, p)
        self.register_buffer(
            "embed", checkpoint_tensor(weights, f"{p}embed_tokens.weight", config)
        )  # [V, H]
        self.register_buffer("norm_w", checkpoint_tensor(weights, f"{p}norm.weight", config))
        if "lm_head.weight" in weights:
            self.register_buffer("lm_head", weights["lm_head.weight"])  # [V, H]
        elif config.tie_word_embeddings:
            self.lm_head = self.embed  # tied: the same tensor, no copy
        else:
            raise WeightsError(
                "lm_head.weight is missing and tie_word_embeddings is false: the checkpoint is "
                "incomplete"
            )
        self._rope_len = 0
        self._ensure_rope(min(config.max_position_embeddings, 4096))
        self._compile = compile
        self._build_exec()
        self._compiled = torch.compile(self._run, dynamic=True) if compile else None

    # ---- loading / properties --------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kernel_backend: str = "auto",
        linear_backend: str = "auto",
        compile: bool = False,
        transform_weights: (
            Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None
        ) = None,
    ) -> LeanDecoder:
        """Load a HF model folder (config.json + safetensors). Raises UnsupportedArchitecture before
        reading weights when the architecture is not a Llama-family one, WeightsError for a missing
        folder or tensors. ``transform_weights`` rewrites the HF-named weights before use (e.g.
        merging an export's LoRA adapter).
        """
        config = ModelConfig.from_folder(folder)
        weights = load_safetensors(folder, dtype=dtype, device=device)
        if transform_weights is not None:
            weights = transform_weights(weights)
        return cls(
            config,
            weights,
            kernel_backend=kernel_backend,
            linear_backend=linear_backend,
            compile=compile,
        ).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def sizes(self) -> TargetSizes:
        c = self.config
        return TargetSizes(
            c.num_layers,
            c.hidden_size,
            c.vocab_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.max_position_embeddings,
        )

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on post-norm hidden states [..., H] -> logits [..., V], with the decoder's
        fast linears (EAGLE-1 drafts through the target's head)."""
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self.dtype)  # [M, H]
        with torch.inference_mode():
            logits = self._ops.linear(rows, self._head, None)  # [M, V]
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    @property
    def packed_head(self) -> PackedLinear | None:
        return self._head if isinstance(self._head, PackedLinear) else None

    @property
    def decoder_layers(self) -> nn.Module:
        return self.layers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.embed

    def allocate_cache(self, max_len: int) -> KVCache:
        """A static cache of ``max_len`` slots (batch 1)."""
        c = self.config
        # a window past max_position_embeddings
        if c.sliding_window is not None and max_len > c.sliding_window:
            raise UnsupportedArchitecture(
                f"a {max_len}-token cache exceeds the model's sliding window "
                f"({c.sliding_window} > max_position_embeddings): use a shorter cache"
            )
        return self.allocate_layer_cache(c.num_layers, max_len)

    # ---- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logits_for: str | torch.Tensor = "all",
        taps: Sequence[int] = (),
        head: str = "logits",
    ) -> TargetOutput:
        """Run T new tokens after the cache's committed prefix.

        input_ids [T] long. Their K/V go to slots ``cache.length .. +T-1`` (``cache.length`` is NOT
        advanced: call ``cache.commit(n)`` or ``cache.compact(...)``). New token i attends to the
        whole prefix and to new token j iff ``tree_mask[i, j]`` ([T, T] bool; None = causal).
        ``positions`` [T] default to ``cache.length + arange(T)`` (tree nodes pass ``prefix_len +
        depth``). ``logits_for``: "all", "last" or a LongTensor of row indices.
        ``taps``: decoder layers whose input (residual stream, pre-norm) to return as well.
        ``head``: "logits", or "argmax" for greedy decoding: the LM head reduced to each row's
        argmax on the fly (the first maximum, as ``torch.argmax`` of the logits), without
        materialising [T', V]. Returns a :class:`TargetOutput`: logits [T', V] (model dtype) or
        argmax [T'], post-final-norm hidden [T, H], taps.
        """
        taps = _checked_forward_inputs(
            input_ids, cache, positions, logits_for, head, taps, self.config.num_layers
        )
        self._ensure_rope(
            max(cache.max_len, int(positions.max()) + 1 if positions is not None else 0)
        )
        args = (input_ids, cache.layers, cache.length, tree_mask, positions, logits_for, taps, head)
        if self._compiled is None:
            with torch.inference_mode():
                return TargetOutput(*self._run(*args))
        # inductor cannot trace inference tensors: compiled forwards run as ordinary no-grad code
        with torch.inference_mode(False), torch.no_grad():
            return TargetOutput(*self._compiled(*args))

    def _run(
        self,
        input_ids: torch.Tensor,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        tree_mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        logits_for: str | torch.Tensor,
        taps: tuple[int, ...],
        head: str = "logits",
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        """The forward math (see :meth:`forward`); inputs are already validated."""
        c = self.config
        found: dict[int, torch.Tensor] = {}
        x = F.embedding(input_ids, self.embed)  # [T, H]
        # one native call: layers, final norm, head (the kernels below, bit for bit)
        if self._stack is not None:
            cos, sin = self._rope_rows(start, x.shape[0], positions)  # [T, 1, d]
            return self._stack(x, kv_layers, start, cos, sin, tree_mask, logits_for, taps, head)
        x = self._layers(
            x, 0, c.num_layers, kv_layers, start, tree_mask, positions, taps, found
        )  # [T, H]
        if c.num_layers in taps:
            found[c.num_layers] = x
        hidden = self.final_hidden(x)  # [T, H]
        logits, argmax = self._head_rows(hidden, logits_for, head)
        return logits, hidden, found, argmax

    def _head_rows(
        self, hidden: torch.Tensor, logits_for: str | torch.Tensor, head: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits [T', V], None) or, for ``head="argmax"``, (None, argmax [T']) of the rows
        ``logits_for`` selects from hidden [T, H]."""
        if isinstance(logits_for, str):
            sel = hidden if logits_for == "all" else hidden[-1:]
        else:
            sel = hidden.index_select(0, logits_for.to(hidden.device))  # [T', H]
        if head == "argmax":
            return None, self._ops.argmax(sel, self._head, None)  # [T']: no [T', V] logits written
        return self._ops.linear(sel, self._head, None), None  # logits [T', V]


def _checked_forward_inputs(
    input_ids: torch.Tensor,
    cache: KVCache,
    positions: torch.Tensor | None,
    logits_for: str | torch.Tensor,
    head: str,
    taps: Sequence[int],
    num_layers: int,
) -> tuple[int, ...]:
    """Validate a forward's inputs before any slot is written; -> the taps as a tuple of ints."""
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(
            "input_ids must be a non-empty 1-D LongTensor [T] (batch 1); got "
            f"{tuple(input_ids.shape)}"
        )
    t = input_ids.numel()
    cache.check_fits(t)
    if positions is not None and positions.shape != (t,):
        raise ValueError(f"positions must have shape [{t}], got {tuple(positions.shape)}")
    if isinstance(logits_for, str) and logits_for not in ("all", "last"):
        raise ValueError(
            f"logits_for must be 'all', 'last' or a LongTensor of rows, got {logits_for!r}"
        )
    check_head(head)
    taps = tuple(int(i) for i in taps)
    bad = [i for i in taps if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"taps {bad} outside 0..{num_layers} (layer inputs; num_layers = last output)"
        )
    return taps
