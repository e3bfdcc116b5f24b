"""The embedded adaptive-temperature task: a mixed prompt set whose best fixed temperature differs
by kind.

- ``arithmetic`` (checkable, exact match): "What is a + b?" with one-digit operands.
- ``copy`` (checkable, exact match): "Repeat this word exactly: <word>". Greedy decoding is expected
  to be best for both: every sampled deviation can only lose the one right answer.
- ``continue`` (open-ended, relevance minus repetition): "Continue this text: <start>". Decoding
  greedily, the small embedded target loops or drifts, which the repetition term punishes; sampling
  breaks the loops (the paper's Wikitext-2 repetition setting, in miniature). Measured on 16
  held-out starts, 4 samples, 128 new tokens: reward 0.188 at T=0, 0.411 at T=0.8 (paired +0.223
  [+0.054, +0.398]). Earlier forms gave adaptive decoding nothing to learn: "Write a short story
  about <topic>." at 32-40 new tokens (greedy did not loop yet), and "Continue this sentence in many
  different ways: <start>", where greedy looped on some starts only and was the best fixed
  temperature over 16 held-out prompts (0.439 vs 0.407 at T=0.4).

Prompts are generated deterministically (no files to ship) and split by a fixed rule into ``train``
and ``heldout`` (every fifth prompt of each kind is held out). Records are ``{"id", "kind", "text",
"answer"}`` (``answer`` None for open-ended prompts), the form :mod:`draftsmith.datagen.rewards`
scores.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from draftsmith.common.errors import InputError

SPLITS = ("train", "heldout", "all")
WORDS = (
    "apple",
    "river",
    "garden",
    "silver",
    "window",
    "planet",
    "yellow",
    "thunder",
    "basket",
    "mirror",
    "candle",
    "forest",
    "pencil",
    "rocket",
    "button",
    "island",
    "marble",
    "violin",
    "saddle",
    "tomato",
    "lantern",
    "copper",
    "meadow",
    "falcon",
    "harbor",
    "pepper",
    "jacket",
    "velvet",
    "anchor",
    "cactus",
    "ribbon",
    "glacier",
    "puzzle",
    "orange",
    "bridge",
    "feather",
    "walnut",
    "compass",
    "blanket",
    "dolphin",
    # the second 40 (per_kind 80): appended, so the first 40 prompts of each kind keep their split
    "hammer",
    "carpet",
    "pillow",
    "rabbit",
    "cotton",
    "ladder",
    "needle",
    "turtle",
    "camera",
    "bottle",
    "kettle",
    "spider",
    "parrot",
    "wallet",
    "sponge",
    "helmet",
    "zipper",
    "muffin",
    "lemon",
    "tunnel",
    "canyon",
    "barrel",
    "magnet",
    "pirate",
    "oyster",
    "goblet",
    "trumpet",
    "biscuit",
    "cabinet",
    "diamond",
    "blossom",
    "chimney",
    "penguin",
    "lobster",
    "satchel",
    "thimble",
    "scarf",
    "shovel",
    "teapot",
    "wagon",
)
STARTS = (
    "The cat",
    "My friend",
    "The old house",
    "Every morning",
    "The little boy",
    "In the city",
    "The sun",
    "Our teacher",
    "The river",
    "A dog",
    "The king",
    "My mother",
    "The train",
    "Yesterday",
    "The robot",
    "The garden",
    "At night",
    "The doctor",
    "A bird",
    "The ship",
    "My brother",
    "The forest",
    "The car",
    "The girl",
    "In winter",
    "The baker",
    "The moon",
    "Our team",
    "The farmer",
    "The computer",
    "The town",
    "A storm",
    "The singer",
    "The window",
    "My father",
    "The mountain",
    "The student",
    "The rain",
    "The queen",
    "The clock",
    "The old man",
    "My sister",
    "The village",
    "Last summer",
    "The horse",
    "On the beach",
    "The pilot",
    "Our neighbor",
    "The lake",
    "A cat",
    "The prince",
    "My uncle",
    "The bus",
    "Tomorrow",
    "The scientist",
    "The park",
    "In the morning",
    "The nurse",
    "A fox",
    "The boat",
    "My cousin",
    "The desert",
    "The bicycle",
    "The woman",
    "In spring",
    "The chef",
    "The stars",
    "Our class",
    "The fisherman",
    "The phone",
    "The castle",
    "A wind",
    "The painter",
    "The door",
    "My grandmother",
    "The valley",
    "The teacher",
    "The snow",
    "The wizard",
    "The bell",
)


def _arithmetic(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append(
            {
                "id": f"arithmetic-{i}",
                "kind": "arithmetic",
                "text": f"What is {a} + {b}?",
                "answer": str(a + b),
            }
        )
    return out


def _copy(n: int) -> list[dict]:
    return [
        {
            "id": f"copy-{i}",
            "kind": "copy",
            "text": f"Repeat this word exactly: {WORDS[i]}",
            "answer": WORDS[i],
        }
        for i in range(n)
    ]


def _continue(n: int) -> list[dict]:
    return [
        {
            "id": f"continue-{i}",
            "kind": "continue",
            "answer": None,
            "text": f"Continue this text: {STARTS[i]}",
        }
        for i in range(n)
    ]


def mixed_prompts(split: str = "train", per_kind: int = 80, seed: int = 0) -> list[dict]:
    """The embedded mixed prompt set (kinds interleaved) of ``split``: train, heldout (every fifth
    prompt) or all.

    80 prompts per kind (64 train, 16 held out). The first 40 of each kind are the set of earlier
    versions, with the same split; the second 40 were added because 8 held-out open-ended prompts
    gave too wide an interval (whether greedy decoding loops depends a lot on the prompt)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 1 <= per_kind <= min(len(WORDS), len(STARTS)):
        raise ValueError(
            f"per_kind must be 1..{min(len(WORDS), len(STARTS))} (distinct words and starts), got "
            f"{per_kind}"
        )
    kinds = [_arithmetic(per_kind, seed), _copy(per_kind), _continue(per_kind)]
    rows = [p for group in zip(*kinds) for p in group]
    if split == "all":
        return rows
    held = {i for i in range(len(rows)) if (i // len(kinds)) % 5 == 4}
    return [p for i, p in enumerate(rows) if (i in held) == (split == "heldout")]


def load_prompt_records(spec: str, limit: int | None = None) -> list[dict]:
    """Prompt records from ``embedded`` / ``embedded:train|heldout|all`` or a ``.jsonl`` file of
    ``{"text"|"prompt", "kind"?, "answer"?}`` objects (kind defaults to ``default``)."""
    if spec.startswith("embedded"):
        _, _, split = spec.partition(":")
        rows = mixed_prompts(split or "train")
    else:
        path = Path(spec)
        if not path.is_file():
            raise InputError(
                f"--prompts {spec!r}: not 'embedded[:train|heldout|all]' or an existing .jsonl file"
            )
        rows = []
        for n, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            rec = json.loads(line)
            text = rec.get("text", rec.get("prompt"))
            if not isinstance(text, str) or not text.strip():
                raise InputError(
                    f"{path}:{n + 1}: each line needs a non-empty 'text' (or 'prompt')"
                )
            rows.append(
                {
                    "id": str(rec.get("id", n)),
                    "kind": str(rec.get("kind", "default")),
                    "text": text,
                    "answer": rec.get("answer"),
                }
            )
    if not rows:
        raise InputError(f"--prompts {spec!r} holds no prompts")
    return rows[:limit] if limit else rows
