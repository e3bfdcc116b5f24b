"""The HF fallback decoder: a transformers causal LM behind the runtime decoder interface, and
its exact logits (the model's own LM-head post-processing included)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.common.errors import InputError
from draftsmith.common.hf_forward import hf_forward  # noqa: F401 - the fallback's forward
from draftsmith.kernels.verify import target_argmax
from draftsmith.runtime.target.cache import CacheFullError, CommitMixin
from draftsmith.runtime.target.interface import TargetDecoder, check_head
from draftsmith.runtime.target.model_config import UnsupportedArchitecture
from draftsmith.runtime.target.output import TargetOutput
from draftsmith.runtime.target.weights import find_safetensors, load_hf_config

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types the fallback masks itself
# Families whose tree verification through the fallback tests/test_hf_fallback.py proves token for token (windows
# included); any other family is probed once at load (:func:`probe_trees`) before it may verify trees.
PROVEN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gpt2")
MASKED_ATTENTION = ("eager", "sdpa")  # implementations that read a 4-D additive mask


@dataclass(frozen=True)
class FallbackAttention:
    """How a transformers causal LM attends, as far as the fallback's verification must reproduce it.

    The fallback's cache keeps every token of every layer, so it builds each forward's 4-D mask itself: the tree mask
    (or causal) over the new tokens, ANDed on windowed layers with the sliding window measured in positions (a tree
    node at depth d sees what plain decoding sees at position prefix + d). Models that mix full and windowed layers
    get a ``{layer_type: mask}`` dict, which their forward hands to each layer.
    """

    name: str
    windows: dict[int, int]  # layer index -> sliding window (tokens), as the model applies it
    layer_types: tuple[str, ...]  # the mask keys the model reads (per-layer models); () = one mask for every layer
    refusal: str | None  # why trees cannot be verified exactly; None = they can

    @classmethod
    def of(cls, model: torch.nn.Module) -> FallbackAttention:
        """Read the model's config and forward: its windows, whether it takes per-layer masks, what it cannot do."""
        cfg = model.config
        name = type(model).__name__.removesuffix("ForCausalLM")
        base = getattr(model, model.base_model_prefix, model)
        try:
            source = inspect.getsource(type(base).forward)
        except (OSError, TypeError):
            source = ""
        per_layer = re.search(r"isinstance\((causal_mask_mapping := )?attention_mask, dict\)", source) is not None
        types = tuple(getattr(cfg, "layer_types", None) or ())
        window = getattr(cfg, "sliding_window", None)
        windows: dict[int, int] = {}
        if window and "create_sliding_window_causal_mask" in source:
            layers = range(int(cfg.num_hidden_layers))
            windows = {i: int(window) for i in layers if not (per_layer and types) or types[i] == SLIDING}
        keys = tuple(sorted({FULL, SLIDING} | set(types))) if per_layer and types else ()
        return cls(name, windows, keys, _refusal(name, cfg, windows, keys, per_layer, types))

    def masks(self, p: int, pos: torch.Tensor, tree_mask: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive [1, 1, T, P+T] mask(s) for T new tokens at positions ``pos`` after ``p`` committed slots (slot j
        holds position j); ``tree_mask`` [T, T] bool, None = causal."""
        t = pos.numel()
        allowed = torch.ones(t, p + t, dtype=torch.bool, device=pos.device)  # [T, P+T]
        own = tree_mask if tree_mask is not None else torch.ones(t, t, dtype=torch.bool).tril()
        allowed[:, p:] = own.to(pos.device)
        if not self.windows:
            return _additive(allowed, dtype)
        gap = pos[:, None] - torch.cat([torch.arange(p, device=pos.device), pos])[None, :]  # [T, P+T] query - key
        sliding = allowed & (gap < next(iter(self.windows.values())))
        if not self.layer_types:
            return _additive(sliding, dtype)  # every layer has the window
        return {key: _additive(sliding if key == SLIDING else allowed, dtype) for key in self.layer_types}


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [T, S] -> additive [1, 1, T, S] (0 where allowed, the dtype's minimum elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _refusal(name: str, cfg: object, windows: dict[int, int], keys: tuple[str, ...], per_layer: bool,
             types: tuple[str, ...]) -> str | None:
    """One line naming the attention feature the fallback cannot verify trees through exactly, or None."""
    head = f"the transformers fallback cannot verify trees for {name}"
    tail = "; serve it without --drafter (plain generation through the fallback is exact) or with --backend lean " \
           "once the lean decoder supports it"
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        return f"{head} with {', '.join(other)} layers: the fallback builds full and sliding-window masks only{tail}"
    if getattr(cfg, "attention_chunk_size", None):
        return f"{head} with chunked attention (chunks of {cfg.attention_chunk_size}): the fallback does not " \
               f"chunk its tree masks{tail}"
    if getattr(cfg, "alibi", False) or getattr(cfg, "model_type", "") in ("bloom", "mpt"):
        return f"{head} with ALiBi position biases: they follow cache slots, not the tree's positions{tail}"
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in MASKED_ATTENTION:
        return f"{head} with attn_implementation={impl!r}: it ignores the tree's 4-D mask (use eager or sdpa){tail}"
    if windows and per_layer and not keys:
        layers = ",".join(str(i) for i in sorted(windows))
        return f"{head} with a sliding window (layers {layers}: window {next(iter(windows.values()))}): its config " \
               f"names no layer types to mask per layer{tail}"
    return None


@torch.inference_mode()
def probe_trees(adapter: HFModelAdapter, prefix: int = 8) -> str | None:
    """Verify a small tree through the fallback and compare every node's logits with the model's own uncached forward
    of that node's path; None when they agree, else the refusal line. Proves a family no test covers, at load."""
    shortest = min(adapter.attention.windows.values(), default=None)
    n = prefix + (shortest + 2 if shortest is not None and shortest < 64 else 0)  # reach past a small window
    vocab = int(adapter.embed_weight.shape[0])
    ids = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(0)).to(adapter.device)
    parents, depths = [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    tokens = torch.randint(vocab, (5,), generator=torch.Generator().manual_seed(1)).to(adapter.device)
    paths: list[list[int]] = []
    for i, p in enumerate(parents):  # parents precede children
        paths.append((paths[p] if p >= 0 else []) + [i])
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i, path in enumerate(paths):
        mask[i, path] = True
    cache = adapter.allocate_cache(n + 5)
    adapter(ids, cache, logits_for="last")
    cache.commit(n)
    got = adapter(tokens, cache, tree_mask=mask, positions=n + torch.tensor(depths, device=adapter.device)).logits
    tol = 1e-3 if adapter.dtype == torch.float32 else 5e-2
    for i, path in enumerate(paths):
        want = adapter.hf(torch.cat([ids, tokens[path]])[None]).logits[0, -1]  # [V]
        err = float((got[i] - want).abs().max())
        if err > tol * max(1.0, float(want.abs().max())):
            return f"the transformers fallback cannot verify trees for {adapter.attention.name}: a probe tree's " \
                   f"logits differ from the model's own forward by {err:.3g} (attention the fallback does not " \
                   "reproduce); serve it without --drafter (plain generation through the fallback is exact)"
    return None


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


class HFModelAdapter(TargetDecoder, torch.nn.Module):
    """Any transformers causal LM behind the :class:`~draftsmith.runtime.target.interface.TargetDecoder` interface (the
    fallback for architectures the lean decoder lacks).

    Tree masks become a 4D additive mask; the hidden state returned is the base model's ``last_hidden_state``
    (post final norm). ``head="argmax"`` is the argmax of the exact logits (the same tokens, no cheaper). Slower than
    the lean decoder, kept simple and correct.
    """

    argmax_head = True  # greedy loops may ask for head="argmax": the argmax of the logits, exactly

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf_model.eval()
        self.config = hf_model.config
        self.attention = FallbackAttention.of(hf_model)
        self.tree_refusal = self.attention.refusal  # None: tree verification is exact; else why it is refused
        self._probed = False

    def check_speculative(self) -> None:
        """Refuse (one line) to verify trees unless it is exact: a known feature the fallback cannot mask, or, for a
        family no test proves, a probe tree whose logits differ from the model's own forward."""
        if self.tree_refusal is None and not self._probed and self.config.model_type not in PROVEN_FAMILIES:
            self.tree_refusal = probe_trees(self)
        self._probed = True
        self._check_trees()

    def _check_trees(self) -> None:
        """Raise :class:`UnsupportedArchitecture` when this model's tree verification would not be exact."""
        if self.tree_refusal is not None:
            raise UnsupportedArchitecture(self.tree_refusal)

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

    def _check_inputs(self, input_ids: torch.Tensor, taps: Sequence[int]) -> tuple[int, ...]:
        """The taps as ints, after checking them and ``input_ids`` [T]."""
        taps = tuple(int(i) for i in taps)
        num_layers = int(self.hf.config.num_hidden_layers)
        bad = [i for i in taps if not 0 <= i < num_layers]
        if bad:
            raise InputError(f"the HF fallback can tap decoder-layer inputs 0..{num_layers - 1}, not {bad}; load the "
                             "target with the lean decoder (backend='lean') for the pre-norm last output")
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError("input_ids must be a non-empty 1-D LongTensor [T] (batch 1); got "
                             f"{tuple(input_ids.shape)}")
        return taps

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HFCache,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logits_for: str | torch.Tensor = "all",
        taps: Sequence[int] = (),
        head: str = "logits",
    ) -> TargetOutput:
        """Same contract as :meth:`LeanDecoder.forward`; taps come from transformers' ``hidden_states`` (the input
        of each decoder layer), so layer ``num_layers`` (the pre-norm last output, which HF does not expose) is
        refused. ``head="argmax"``: the first maximum of each logits row (the model's own post-processing, e.g.
        softcaps, included), as ``torch.argmax`` of the logits."""
        check_head(head)
        taps = self._check_inputs(input_ids, taps)
        t = input_ids.numel()
        cache.check_fits(t)
        cache.sync()
        p = cache.length
        pos = positions if positions is not None else torch.arange(p, p + t, device=input_ids.device)
        if tree_mask is not None and (tree_mask.shape != (t, t) or tree_mask.dtype != torch.bool):
            raise ValueError(f"tree_mask must be bool [{t}, {t}]; got {tree_mask.dtype} {tuple(tree_mask.shape)}")
        if tree_mask is not None or (positions is not None and t > 1):
            self._check_trees()  # a tree (or positions other than the slots) is served exactly or refused
        windows = bool(self.attention.windows)  # the cache keeps every token: the fallback masks windows itself
        mask = self.attention.masks(p, pos, tree_mask, self.dtype) if tree_mask is not None or windows else None
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
        if head == "argmax":
            return TargetOutput(None, out.last_hidden_state[0], found, target_argmax(logits[0]))  # argmax [T']
        return TargetOutput(logits[0], out.last_hidden_state[0], found)  # [T', V], [T, H] post final norm
