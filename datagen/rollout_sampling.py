"""The decoder's own samples, what LPO learns from: N responses of one prompt drawn with a HF
causal LM, each token at the grid temperature the adaptive-temperature head (or a uniform draw)
picks, with that index recorded per token; and the token ids that end a response."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from draftsmith.common.hf_forward import backbone, hf_forward
from draftsmith.controllers.adaptive_temperature import AdaptiveTemperatureHead
from draftsmith.runtime.acceptance.verifiers import target_probs


@torch.no_grad()
def sample_group(
    model: Any,
    prompt_ids: Sequence[int],
    n: int,
    grid: Sequence[float],
    granularity: str,
    head: AdaptiveTemperatureHead | None = None,
    max_new_tokens: int = 64,
    eos_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    choice: str = "sample",
) -> list[tuple[list[int], list[int]]]:
    """N sampled responses of one prompt with a HF causal LM -> ``[(tokens, temperature indices)]``,
    each cut after its first eos. The head (or a uniform draw when None) picks the index from the
    post-norm hidden state that produces the token's logits: once per response (``sequence``) or at
    every token (``token``); ``choice`` is ``sample`` (a draw from the head: what LPO learns from)
    or ``greedy`` (its argmax: how it is served).
    """
    base = backbone(model)  # the module its forward runs for the hidden states (OPT: the decoder)
    device = next(model.parameters()).device
    temps = torch.tensor(list(grid), dtype=torch.float64)  # [K]
    # [P] -> [N, P]
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device).repeat(n, 1)
    out, logits = hf_forward(model, base, 1, input_ids=ids, use_cache=True)
    tokens, choices, fixed = [], [], None
    eos, finished = torch.tensor(list(eos_ids), dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        hidden = out.last_hidden_state[:, -1]  # [N, H] post-norm
        if fixed is None or granularity == "token":
            fixed = _temperature_indices(hidden, len(temps), head, choice, generator)  # [N]
        probs = target_probs(logits[:, -1].cpu(), temps[fixed])  # [N, V] float64
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [N]
        tokens.append(tok)
        choices.append(fixed)
        finished |= torch.isin(tok, eos)
        # rows past their eos keep sampling until every row is done; their tail is cut
        if bool(finished.all()):
            break
        out, logits = hf_forward(
            model,
            base,
            1,
            input_ids=tok[:, None].to(device),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return _cut_after_eos(tokens, choices, eos_ids)


def _temperature_indices(
    hidden: torch.Tensor,
    grid_size: int,
    head: AdaptiveTemperatureHead | None,
    choice: str,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The grid index each of the N rows samples its next token at ([N] long, on the CPU): the
    head's choice from ``hidden`` [N, H], else a uniform draw."""
    n = hidden.shape[0]
    if head is None and grid_size == 1:
        # a fixed temperature draws nothing: its token draws then match a layer's that picks the
        # same temperature (paired benches)
        return torch.zeros(n, dtype=torch.long)
    if head is None:
        return torch.randint(grid_size, (n,), generator=generator)
    return head.choose(hidden, choice, generator).cpu()


def _cut_after_eos(
    tokens: list[torch.Tensor], choices: list[torch.Tensor], eos_ids: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Per row, the sampled tokens and their temperature indices up to and with its first eos."""
    toks, idxs = torch.stack(tokens, 1).tolist(), torch.stack(choices, 1).tolist()  # [N, L]
    result = []
    for row, rix in zip(toks, idxs):
        end = next((t + 1 for t, tok in enumerate(row) if tok in eos_ids), len(row))
        result.append((row[:end], rix[:end]))
    return result


def eos_ids_of(tokenizer: Any, model: Any) -> list[int]:
    """The token ids that end a response: the tokenizer's eos and the model's generation-config eos
    (one or a list)."""
    extra = model.generation_config.eos_token_id
    extra = list(extra) if isinstance(extra, list | tuple) else [extra]
    return sorted({i for i in (tokenizer.eos_token_id, *extra) if i is not None})
