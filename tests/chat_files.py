"""Chat data files the data tests write: records as JSONL, and ShareGPT conversations of varied
length."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, records: list) -> Path:
    """Write ``records`` to ``path``, one JSON object a line; the path."""
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def varied_conversations(n: int) -> list[dict]:
    """``n`` ShareGPT records of one question and one answer, each repeated 1-4 and 1-3 times."""
    return [
        {
            "conversations": [
                {"from": "human", "value": "hello world " * (1 + i % 4)},
                {"from": "gpt", "value": "the answer is python ." * (1 + i % 3)},
            ]
        }
        for i in range(n)
    ]
