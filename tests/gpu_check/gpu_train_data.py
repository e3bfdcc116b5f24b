"""``make gpu-train``'s training data: tokenised conversations, compact and compressed, and put
where the trainer finds them on the GPU machine.

The machine has no network and takes 64 MiB a command, so the data travels tokenised: token ids as
uint16 (the vocabulary is below 65,536), loss masks as bits, lengths as uint32, in one ``.npz``
compressed with lzma (about 0.8 bytes a token on ShareGPT). :func:`choose_samples` keeps as many
conversations (in a seeded order) as fit the byte budget. There, :func:`install_samples` writes them
into the tokenised-sample cache exactly where ``ChatDataModule`` looks for them (the path it
computes from the data spec, the tokenizer and ``max_length``), so ``train.py`` reads them as if it
had tokenised the data itself; the tokenizer's fingerprint must match the one the data was made
with.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
from pathlib import Path
from typing import Any

import numpy as np

BYTES_PER_TOKEN_GUESS = 0.85  # lzma-compressed uint16 ids of chat text (measured 0.81 on ShareGPT)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the tokenizer's vocabulary and chat template: data tokenised here trains
    there only if equal."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    text = json.dumps([vocab, tokenizer.chat_template or ""], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode_samples(samples: list[dict], meta: dict[str, Any]) -> bytes:
    """``samples`` (``input_ids``, ``loss_mask``) as lzma-compressed npz bytes with ``meta`` (JSON)
    inside."""
    lengths = np.asarray([len(s["input_ids"]) for s in samples], dtype=np.uint32)
    ids = np.concatenate([np.asarray(s["input_ids"]) for s in samples]) if samples else np.zeros(0)
    if ids.size and int(ids.max()) >= 1 << 16:
        raise ValueError(
            f"token id {int(ids.max())} does not fit uint16; this packing is for vocabularies <"
            " 65,536"
        )
    masks = (
        np.concatenate([np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples])
        if samples
        else np.zeros(0)
    )
    buffer = io.BytesIO()
    np.savez(
        buffer,
        ids=ids.astype(np.uint16),
        mask=np.packbits(masks.astype(bool)),
        lengths=lengths,
        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
    )
    return lzma.compress(buffer.getvalue(), preset=6)


def decode_samples(blob: bytes) -> tuple[list[dict], dict[str, Any]]:
    """The samples and metadata of :func:`encode_samples`' bytes."""
    with np.load(io.BytesIO(lzma.decompress(blob))) as data:
        lengths, ids = data["lengths"].astype(np.int64), data["ids"].astype(np.int64)
        mask = np.unpackbits(data["mask"])[: len(ids)].astype(np.int64)
        meta = json.loads(data["meta"].tobytes().decode())
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    samples = [
        {"input_ids": ids[a:b].tolist(), "loss_mask": mask[a:b].tolist()}
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return samples, meta


def choose_samples(
    samples: list[dict], budget_bytes: int, meta: dict[str, Any], seed: int = 0
) -> bytes:
    """The encoded samples (seeded order) that fit ``budget_bytes``: a first cut from the measured
    compression rate, then trimmed by a tenth until the bytes fit."""
    order = np.random.default_rng(seed).permutation(len(samples))
    lengths = np.asarray([len(samples[i]["input_ids"]) for i in order])
    count = int(
        np.searchsorted(np.cumsum(lengths), budget_bytes / BYTES_PER_TOKEN_GUESS, side="right")
    )
    count = max(1, min(count, len(samples)))
    while True:
        chosen = [samples[i] for i in order[:count]]
        blob = encode_samples(
            chosen, {**meta, "samples": count, "tokens": int(lengths[:count].sum())}
        )
        if len(blob) <= budget_bytes or count == 1:
            return blob
        count = max(1, int(count * 0.9))


def install_samples(datamodule: Any, samples: list[dict], meta: dict[str, Any]) -> Path:
    """Write ``samples`` into ``datamodule``'s tokenised-sample cache (its own ``cache_path``),
    after checking that its tokenizer is the one the data was made with."""
    from draftsmith.distill.data.datamodule import save_samples

    found = tokenizer_fingerprint(datamodule.tokenizer)
    if meta.get("tokenizer") != found:
        raise ValueError(
            f"the data was tokenised with tokenizer {meta.get('tokenizer')}, this target's is"
            f" {found}: prepare the data again with the same target"
        )
    if int(meta.get("max_length", datamodule.max_length)) != int(datamodule.max_length):
        raise ValueError(
            f"the data was cut at max_length {meta['max_length']}, the run asks for "
            f"{datamodule.max_length}"
        )
    path = datamodule.cache_path
    save_samples(path, samples, {"shipped": meta})
    return path
