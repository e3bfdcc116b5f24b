"""Whether the two engines of ``draftsmith engine-check`` agree: llama.cpp's speculative text
against its plain one (and where they part, how near the target's two candidates were), the
prompt ids both engines decode from, and our runtime's greedy ids against llama.cpp's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def texts_lossless(plain: str, plain_eos: bool, speculative: str) -> bool:
    """The speculative text is llama.cpp's plain greedy text: equal, or (plain cut at ``-n``)
    extending it."""
    return speculative == plain if plain_eos else speculative.startswith(plain)


def divergences(
    runtime: Any,
    ids: list[list[int]],
    plain: list[str],
    speculative: list[str],
    lossless: list[bool],
) -> list[dict[str, Any] | None]:
    """Per prompt, where llama.cpp's speculative text leaves its plain one and how near the target's
    two candidates were there (:mod:`draftsmith.evals.near_ties`, judged by the target in fp32);
    None where the texts agree.
    """
    from draftsmith.evals.near_ties import divergence
    from draftsmith.runtime.target.loading import load_decoder

    if all(lossless):
        return [None] * len(ids)
    judge = (
        runtime.model
        if runtime.model.dtype == torch.float32
        else load_decoder(runtime.folder, torch.float32)
    )
    return [
        None if ok else divergence(judge, runtime.tokenizer, p, a, b)
        for p, a, b, ok in zip(ids, plain, speculative, lossless, strict=True)
    ]


def shared_prompt_ids(
    hf_ids: list[list[int]], engine_ids: list[list[int] | None]
) -> tuple[list[list[int]], dict[str, Any]]:
    """The prompt ids both engines decode from: llama.cpp's own tokenization of each rendered prompt
    (its tools take text, not ids, and tokenize some texts, e.g. ``"\\n 3"``, unlike the HF
    tokenizer), so our runtime is fed those; the HF tokenizer's ids where llama.cpp's could not be
    read. Returns ``(ids, report)``."""
    ids = [list(e) if e is not None else list(h) for h, e in zip(hf_ids, engine_ids, strict=True)]
    unreadable = [i for i, e in enumerate(engine_ids) if e is None]
    return ids, {
        "fed_to_both": "llama.cpp's tokenization of the rendered prompt",
        "same_in_both_engines": not unreadable,
        "llamacpp_ids_unreadable": unreadable,
        "hf_tokenizer_differs": [
            i
            for i, (h, e) in enumerate(zip(hf_ids, engine_ids))
            if e is not None and list(e) != list(h)
        ],
    }


def generated_ids_agree(
    ours: list[int],
    theirs: list[int],
    eos_ids: Sequence[int],
    engine_stopped_at_eos: bool,
) -> bool:
    """Whether our greedy ids are llama.cpp's: ``theirs`` are the ids its log lists as evaluated,
    which never include the EOS it stopped at nor the last token of a run cut at ``-n`` (sampled,
    never evaluated)."""
    body = ours[:-1] if ours and ours[-1] in eos_ids else ours
    if engine_stopped_at_eos:
        return body == list(theirs) and len(body) < len(
            ours
        )  # both stopped at EOS, after the same tokens
    return len(body) - len(theirs) in (0, 1) and body[: len(theirs)] == list(theirs)


def same_generated_ids(
    ours: list[list[int]], plain: dict[str, Any], runtime: Any
) -> list[bool | None]:
    """Per prompt: our runtime's AR ids equal llama.cpp plain's (compared as ids: its text drops
    EOS, ours keeps ``<|im_end|>``); where llama.cpp's ids are not in its log, the texts without
    special tokens (None if neither).
    """
    out: list[bool | None] = []
    for mine, theirs, eos, text in zip(
        ours, plain["generated_ids"], plain["stopped_at_eos"], plain["texts"], strict=True
    ):
        if theirs is not None:
            out.append(generated_ids_agree(mine, theirs, runtime.eos_ids, eos))
        else:
            out.append(
                runtime.tokenizer.decode(mine, skip_special_tokens=True) == text
                if text is not None
                else None
            )
    return out
