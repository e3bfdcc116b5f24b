"""The HF fallback decoder: a transformers causal LM behind the runtime decoder interface, and
its exact logits (the model's own LM-head post-processing included)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from draftsmith.common.hf_forward import hf_forward  # noqa: F401 - the fallback's forward
from draftsmith.runtime.target.cache import CacheFullError, CommitMixin
from draftsmith.runtime.target.output import TargetOutput
from draftsmith.runtime.target.weights import find_safetensors, load_hf_config


class HFCache(CommitMixin):
    """A transformers ``DynamicCache`` behind the static-cache interface.

    The DynamicCache grows by T on every forward; ``length`` counts what the caller kept, and the next forward first
    crops the DynamicCache back to ``length``. Compaction gathers the kept slots.
    """

    def __init__(self, max_len: int) -> None:
        from transformers import DynamicCache

        # No config on purpose: plain full-attention layers that can be cropped/gathered (sliding-window layers keep
        # a rolling buffer that cannot); the model's own mask logic still applies windows.
        self.dc = DynamicCache()
        self.max_len = max_len
        self.length = 0

    def check_fits(self, new_tokens: int) -> None:
        """Raise CacheFullError unless ``new_tokens`` more tokens fit."""
        if self.length + new_tokens > self.max_len:
            raise CacheFullError(
                f"{new_tokens} new tokens do not fit: the cache holds {self.length} of {self.max_len} slots; "
                "allocate a larger cache or shorten the prompt / max_new_tokens"
            )

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every layer's K and V [1, Hkv, S, d] by ``fn`` of them."""
        if hasattr(self.dc, "layers"):  # transformers >= 4.56: per-layer objects holding .keys / .values
            for layer in self.dc.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys, layer.values = fn(layer.keys), fn(layer.values)
        else:  # older transformers: parallel lists
            self.dc.key_cache = [fn(k) for k in self.dc.key_cache]
            self.dc.value_cache = [fn(v) for v in self.dc.value_cache]

    def sync(self) -> None:
        """Drop uncommitted slots (those past ``length``) before the next forward."""
        if self.dc.get_seq_length() > self.length:
            self._map(lambda t: t[:, :, : self.length])  # [1, Hkv, length, d]

    def compact(self, src_slots: torch.Tensor, dst_start: int | None = None) -> None:
        """Keep slots ``0..dst_start-1`` then ``src_slots`` (ascending); the length becomes ``dst_start + n``."""
        dst = self.length if dst_start is None else dst_start
        if dst > self.length:
            raise ValueError(f"dst_start {dst} is past the committed length {self.length}; that would leave a gap")
        keep = torch.cat([torch.arange(dst), src_slots.cpu().long()])
        self._map(lambda t: t.index_select(2, keep.to(t.device)))
        self.length = dst + int(src_slots.numel())

    def crop(self, length: int) -> None:
        """Roll back to the first ``length`` committed tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        self.length = length


class HFModelAdapter(torch.nn.Module):
    """Any transformers causal LM behind the LeanDecoder interface (the fallback for non-Llama architectures).

    Tree masks become a 4D additive mask; the hidden state returned is the base model's ``last_hidden_state``
    (post final norm). Slower than the lean decoder, kept simple and correct.
    """

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf_model.eval()
        self.config = hf_model.config

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        transform_weights: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> HFModelAdapter:
        """Load a local HF folder with ``AutoModelForCausalLM`` (no hub access, no remote code); ``transform_weights``
        rewrites its HF-named weights (e.g. merging an export's LoRA adapter)."""
        from transformers import AutoModelForCausalLM

        load_hf_config(folder)  # clear errors for a missing folder / config
        find_safetensors(folder)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
        if transform_weights is not None:
            with torch.no_grad():
                model.load_state_dict(transform_weights(dict(model.state_dict())))
        return cls(model.to(device))

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_output_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_output_embeddings().weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.hf.get_input_embeddings().weight

    def allocate_cache(self, max_len: int) -> HFCache:
        """A DynamicCache-backed cache bounded to ``max_len`` tokens."""
        if max_len < 1:
            raise ValueError(f"cache max_len must be >= 1, got {max_len}")
        return HFCache(max_len)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HFCache,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logits_for: str | torch.Tensor = "all",
        taps: Sequence[int] = (),
    ) -> TargetOutput:
        """Same contract as :meth:`LeanDecoder.forward`; taps come from transformers' ``hidden_states`` (the input
        of each decoder layer), so layer ``num_layers`` (the pre-norm last output, which HF does not expose) is
        refused."""
        taps = tuple(int(i) for i in taps)
        num_layers = int(self.hf.config.num_hidden_layers)
        bad = [i for i in taps if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"the HF fallback can tap decoder-layer inputs 0..{num_layers - 1}, not {bad}; load the "
                             "target with the lean decoder (backend='lean') for the pre-norm last output")
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D LongTensor [T] (batch 1); got {tuple(input_ids.shape)}")
        t = input_ids.numel()
        cache.check_fits(t)
        cache.sync()
        p = cache.length
        pos = positions if positions is not None else torch.arange(p, p + t, device=input_ids.device)
        mask = None
        if tree_mask is not None:
            if tree_mask.shape != (t, t) or tree_mask.dtype != torch.bool:
                raise ValueError(f"tree_mask must be bool [{t}, {t}]; got {tree_mask.dtype} {tuple(tree_mask.shape)}")
            mask = torch.zeros(1, 1, t, p + t, dtype=self.dtype, device=input_ids.device)  # [1, 1, T, P+T] additive
            mask[0, 0, :, p:].masked_fill_(~tree_mask.to(input_ids.device), torch.finfo(self.dtype).min)
        if isinstance(logits_for, str):
            if logits_for not in ("all", "last"):
                raise ValueError(f"logits_for must be 'all', 'last' or a LongTensor of rows, got {logits_for!r}")
            keep: int | torch.Tensor = 0 if logits_for == "all" else 1
        else:
            keep = logits_for.to(input_ids.device).long()
        base = getattr(self.hf, self.hf.base_model_prefix)
        out, logits = hf_forward(self.hf, base, keep, input_ids=input_ids[None], position_ids=pos[None],
                                 attention_mask=mask, past_key_values=cache.dc, use_cache=True,
                                 output_hidden_states=bool(taps))
        found = {i: out.hidden_states[i][0] for i in taps}  # hidden_states[i] = input of layer i, [T, H]
        return TargetOutput(logits[0], out.last_hidden_state[0], found)  # [T', V], [T, H] post final norm
