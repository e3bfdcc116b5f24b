"""The HF fallback decoder: a transformers causal LM behind the runtime decoder interface, and
its exact logits (the model's own LM-head post-processing included)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from draftsmith.common.errors import InputError
from draftsmith.common.hf_forward import backbone, hf_forward
from draftsmith.kernels.verify import target_argmax
from draftsmith.runtime.target.hf_attention import FallbackAttention, hf_sizes
from draftsmith.runtime.target.hf_cache import HFCache
from draftsmith.runtime.target.interface import TargetDecoder, TargetSizes, check_head
from draftsmith.runtime.target.model_config import UnsupportedArchitecture
from draftsmith.runtime.target.output import TargetOutput
from draftsmith.runtime.target.weights import check_custom_code, find_safetensors

# Families whose tree verification through the fallback tests/test_hf_fallback.py proves token for
# token (windows included); any other family is probed once at load (:func:`probe_trees`) before it
# may verify trees.
PROVEN_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt2",
)


@torch.inference_mode()
def probe_trees(adapter: HFModelAdapter, prefix: int = 8) -> str | None:
    """Verify a small tree through the fallback and compare every node's logits with the model's own
    uncached forward of that node's path; None when they agree, else the refusal line. Proves a
    family no test covers, at load.
    """
    shortest = min(adapter.attention.windows.values(), default=None)
    n = prefix + (
        shortest + 2 if shortest is not None and shortest < 64 else 0
    )  # reach past a small window
    vocab = int(adapter.embed_weight.shape[0])
    ids = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(0)).to(adapter.device)
    parents, depths = [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    tokens = torch.randint(vocab, (5,), generator=torch.Generator().manual_seed(1)).to(
        adapter.device
    )
    paths: list[list[int]] = []
    for i, p in enumerate(parents):  # parents precede children
        paths.append((paths[p] if p >= 0 else []) + [i])
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i, path in enumerate(paths):
        mask[i, path] = True
    cache = adapter.allocate_cache(n + 5)
    adapter(ids, cache, logits_for="last")
    cache.commit(n)
    got = adapter(
        tokens, cache, tree_mask=mask, positions=n + torch.tensor(depths, device=adapter.device)
    ).logits
    tol = 1e-3 if adapter.dtype == torch.float32 else 5e-2
    for i, path in enumerate(paths):
        want = adapter.hf(torch.cat([ids, tokens[path]])[None]).logits[0, -1]  # [V]
        err = float((got[i] - want).abs().max())
        if err > tol * max(1.0, float(want.abs().max())):
            return (
                f"the transformers fallback cannot verify trees for {adapter.attention.name}: a"
                f" probe tree's logits differ from the model's own forward by {err:.3g} (attention"
                " the fallback does not reproduce); serve it without --drafter (plain generation"
                " through the fallback is exact)"
            )
    return None


class HFModelAdapter(TargetDecoder):
    """Any transformers causal LM behind the
    :class:`~draftsmith.runtime.target.interface.TargetDecoder` interface (the fallback for
    architectures the lean decoder lacks).

    Tree masks become a 4D additive mask; the hidden state returned is the base model's
    ``last_hidden_state`` (post final norm). ``head="argmax"`` is the argmax of the exact logits
    (the same tokens, no cheaper). Slower than the lean decoder, kept simple and correct.
    """

    argmax_head = True  # greedy loops may ask for head="argmax": the argmax of the logits, exactly

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf_model.eval()
        self.config = hf_model.config
        self.base = backbone(
            hf_model
        )  # the module the model's forward runs for its hidden states (OPT: the decoder)
        self.attention = FallbackAttention.of(hf_model, self.base)
        # None: tree verification is exact; else why it is refused
        self.tree_refusal = self.attention.refusal
        self._probed = False

    def check_speculative(self) -> None:
        """Refuse (one line) to verify trees unless it is exact: a known feature the fallback cannot
        mask, or, for a family no test proves, a probe tree whose logits differ from the model's own
        forward."""
        if (
            self.tree_refusal is None
            and not self._probed
            and self.config.model_type not in PROVEN_FAMILIES
        ):
            self.tree_refusal = probe_trees(self)
        self._probed = True
        self._check_trees()

    def _check_trees(self) -> None:
        """Raise :class:`UnsupportedArchitecture` when this model's tree verification would not be
        exact."""
        if self.tree_refusal is not None:
            raise UnsupportedArchitecture(self.tree_refusal)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        transform_weights: (
            Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None
        ) = None,
        trust_remote_code: bool = False,
    ) -> HFModelAdapter:
        """Load a local HF folder with ``AutoModelForCausalLM`` (no hub access; the folder's own
        code only with ``trust_remote_code``, else refused in one line); ``transform_weights``
        rewrites its HF-named weights (e.g. merging an export's LoRA adapter)."""
        from transformers import AutoModelForCausalLM

        custom = check_custom_code(
            folder, trust_remote_code
        )  # also: clear errors for a missing folder / config
        find_safetensors(folder)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, local_files_only=True, trust_remote_code=custom
        )
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
    def sizes(self) -> TargetSizes:
        return hf_sizes(self.config)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's LM head module on post-norm hidden states [..., H] -> [..., V] (its bias
        included)."""
        with torch.inference_mode():
            return self.hf.get_output_embeddings()(hidden.to(self.dtype))

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
            raise InputError(
                f"the HF fallback can tap decoder-layer inputs 0..{num_layers - 1}, not {bad}; load"
                " the target with the lean decoder (backend='lean') for the pre-norm last output"
            )
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(
                "input_ids must be a non-empty 1-D LongTensor [T] (batch 1); got "
                f"{tuple(input_ids.shape)}"
            )
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
        """Same contract as :meth:`LeanDecoder.forward`; taps come from transformers'
        ``hidden_states`` (the input of each decoder layer), so layer ``num_layers`` (the pre-norm
        last output, which HF does not expose) is refused. ``head="argmax"``: the first maximum of
        each logits row (the model's own post-processing, e.g. softcaps, included), as
        ``torch.argmax`` of the logits."""
        check_head(head)
        taps = self._check_inputs(input_ids, taps)
        t = input_ids.numel()
        cache.check_fits(t)
        cache.sync()
        pos, mask = self._positions_and_mask(
            cache.length, t, tree_mask, positions, input_ids.device
        )
        keep = _kept_rows(logits_for, input_ids.device)
        out, logits = hf_forward(
            self.hf,
            self.base,
            keep,
            input_ids=input_ids[None],
            position_ids=pos[None],
            attention_mask=mask,
            cache=cache.dc,
            use_cache=True,
            output_hidden_states=bool(taps),
        )
        found = {
            i: out.hidden_states[i][0] for i in taps
        }  # hidden_states[i] = input of layer i, [T, H]
        if head == "argmax":
            return TargetOutput(
                None, out.last_hidden_state[0], found, target_argmax(logits[0])
            )  # argmax [T']
        return TargetOutput(
            logits[0], out.last_hidden_state[0], found
        )  # [T', V], [T, H] post final norm

    def _positions_and_mask(
        self,
        p: int,
        t: int,
        tree_mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The positions [T] of ``t`` new tokens after ``p`` cached ones and the attention mask HF
        takes (None when causal attention over every cached token is right)."""
        pos = positions if positions is not None else torch.arange(p, p + t, device=device)
        if tree_mask is not None and (tree_mask.shape != (t, t) or tree_mask.dtype != torch.bool):
            raise ValueError(
                f"tree_mask must be bool [{t}, {t}]; got {tree_mask.dtype} {tuple(tree_mask.shape)}"
            )
        if tree_mask is not None or (positions is not None and t > 1):
            # a tree (or positions other than the slots) is served exactly or refused
            self._check_trees()
        windows = bool(
            self.attention.windows
        )  # the cache keeps every token: the fallback masks windows itself
        mask = (
            self.attention.masks(p, pos, tree_mask, self.dtype)
            if tree_mask is not None or windows
            else None
        )
        return pos, mask


def _kept_rows(logits_for: str | torch.Tensor, device: torch.device) -> int | torch.Tensor:
    """``logits_for`` as transformers' ``logits_to_keep``: 0 (all rows), 1 (the last) or row
    indices."""
    if isinstance(logits_for, str):
        if logits_for not in ("all", "last"):
            raise ValueError(
                f"logits_for must be 'all', 'last' or a LongTensor of rows, got {logits_for!r}"
            )
        return 0 if logits_for == "all" else 1
    return logits_for.to(device).long()
