"""Chat data -> token ids + loss masks, and the LightningDataModule that serves them.

Conventions: a sample is ``{"input_ids": [...], "loss_mask": [...]}`` of equal length; ``loss_mask[t] == 1``
means token ``t`` was written by the assistant (its content and its end-of-turn token), so it is a valid
*label* position. Consumers shift: a head that predicts token ``t + k`` from position ``t`` reads
``loss_mask[t + k]``. Conversations are rendered with the tokenizer's own chat template.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from draftsmith import assets
from draftsmith.assets import (
    ReadReport,
    StreamStats,
    iter_json_records,
    mtbench_questions,
    sharegpt_path,
)

logger = logging.getLogger(__name__)

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_CACHE_VERSION = 1


# --------------------------------------------------------------------------- loading and normalising


def _as_text(content: Any) -> str:
    """Message content as a string (``None`` -> "", OpenAI content parts -> their joined text)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(str(p.get("text", "")) for p in content if p.get("type", "text") == "text")
    raise ValueError(f"message content must be a string, got {type(content).__name__}")


def normalize_record(record: Any) -> list[dict]:
    """One record -> ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.

    Accepts ShareGPT (``conversations: [{from, value}]``), OpenAI (``messages: [{role, content}]``), a bare
    list of such messages, and a ``prompt``/``response`` (or ``completion``) pair with optional ``system``.
    Raises ``ValueError`` for anything else.
    """
    if isinstance(record, dict) and "prompt" in record and ("response" in record or "completion" in record):
        answer = record["response"] if "response" in record else record["completion"]
        system = [{"role": "system", "content": _as_text(record["system"])}] if record.get("system") else []
        return system + [{"role": "user", "content": _as_text(record["prompt"])},
                         {"role": "assistant", "content": _as_text(answer)}]
    turns = record
    if isinstance(record, dict):
        key = "conversations" if "conversations" in record else "messages" if "messages" in record else None
        if key is None:
            raise ValueError(f"unknown record structure (keys {sorted(record)[:8]}); expected 'conversations' "
                             "(ShareGPT), 'messages' (OpenAI) or 'prompt'/'response'")
        turns = record[key]
    if not isinstance(turns, list):
        raise ValueError(f"expected a list of messages, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"message {i} is a {type(turn).__name__}, expected an object with role/content")
        role = turn.get("role", turn.get("from"))
        mapped = _ROLES.get(str(role).lower())
        if mapped is None:
            raise ValueError(f"message {i} has unknown role {role!r}; expected one of {sorted(_ROLES)}")
        out.append({"role": mapped, "content": _as_text(turn.get("content", turn.get("value")))})
    return out


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from err
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _iter_hf_dataset(spec: str) -> Iterator[tuple[int, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"data={spec!r} is not a local file, and loading it as a Hugging Face dataset needs "
                          "`pip install datasets`") from err
    local = Path(spec).expanduser()
    if local.is_dir() and (local / "dataset_info.json").is_file() and (local / "state.json").is_file():
        ds = datasets.load_from_disk(str(local))  # a folder written by Dataset.save_to_disk
    else:
        ds = datasets.load_dataset(spec, split="train")
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    yield from enumerate(ds, start=1)


def load_conversations(spec: str, limit: int | None = None) -> tuple[list[list[dict]], ReadReport]:
    """Load chat conversations as normalised message lists (see :func:`normalize_record`).

    ``spec`` is ``"sharegpt"`` (the embedded file), a local ``.jsonl``/``.json``/``.parquet`` file, or a
    Hugging Face dataset name or folder (``datasets.load_dataset``, split ``train``). Conversations without
    a non-empty assistant turn are dropped and counted. A malformed record in a user file raises a
    ``ValueError`` naming file and line; in the embedded ShareGPT file it is skipped and counted. The
    truncated tail of a JSON array is dropped and reported. ``limit`` caps the conversations returned.
    """
    stats = StreamStats()
    strict = True
    if spec.strip().lower() == "sharegpt":
        source: Any = sharegpt_path()
        records = iter_json_records(source, stats)
        strict = False  # the embedded dump has a few odd records; count them instead of failing
    else:
        source = Path(spec).expanduser()
        suffix = source.suffix.lower()
        if suffix in (".json", ".jsonl", ".parquet") and not source.is_file():
            raise FileNotFoundError(f"data file {source} does not exist")
        if source.is_file() and suffix in (".json", ".jsonl"):
            records = iter_json_records(source, stats)
        elif source.is_file() and suffix == ".parquet":
            records = _iter_parquet(source)
        elif source.is_file():
            raise ValueError(f"unsupported data file {source}: use .jsonl, .json or .parquet")
        else:
            source, records = spec, _iter_hf_dataset(spec)
    conversations: list[list[dict]] = []
    malformed = no_assistant = turns = 0
    for where, record in records:
        try:
            messages = normalize_record(record)
        except ValueError as err:
            if strict:
                raise ValueError(f"{source}:{where}: {err}. Fix the record or convert the file.") from None
            malformed += 1
            continue
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            no_assistant += 1
            continue
        conversations.append(messages)
        turns += len(messages)
        if limit is not None and len(conversations) >= limit:
            break
    reasons = []
    if stats.tail_line is not None:
        reasons.append(f"dropped the truncated last record (line {stats.tail_line}, {stats.tail_chars} chars)")
    if malformed:
        reasons.append(f"skipped {malformed} malformed record(s)")
    if no_assistant:
        reasons.append(f"dropped {no_assistant} conversation(s) without an assistant turn")
    skipped = malformed + no_assistant + (stats.tail_line is not None)
    report = ReadReport(len(conversations), skipped, turns, "; ".join(reasons) or "complete")
    logger.info("data %s: %d conversations, %d turns, %d skipped (%s)", spec, report.kept, turns, skipped,
                report.reason)
    return conversations, report


# --------------------------------------------------------------------------- tokenising


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    unk = tokenizer.unk_token_id
    for tok in _END_OF_TURN:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != unk:
            ids.add(tid)
    return ids


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be split into per-turn spans (so no loss mask)."""


def _assistant_spans(tokenizer: Any, messages: list[dict], full: str, stop_char: int) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of assistant turns in ``full`` (content + end of turn).

    For assistant message ``i`` the span starts after the generation header that the template appends to
    ``messages[:i]`` and ends where ``messages[:i+1]`` ends. Spans starting at or after ``stop_char``
    (beyond truncation) are not computed.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i]) if i else ""
        if len(before) >= stop_char:  # this turn starts after the truncation point
            break
        context = messages[:i] if i else [{"role": "user", "content": "x"}]  # some templates reject []
        plain = before if i else _render(tokenizer, context)
        header = _render(tokenizer, context, generation_prompt=True)[len(plain):]
        after = _render(tokenizer, messages[: i + 1])
        if not full.startswith(after) or not after.startswith(before):
            raise TemplateError("the chat template renders earlier turns differently once later turns are added "
                                "(e.g. it rewrites past assistant turns); such templates are not supported")
        start = after.find(header, len(before)) if header else -1
        if start < 0:
            raise TemplateError(f"the chat template's generation prompt {header!r} does not appear before the "
                                "assistant turn; cannot locate assistant tokens (template unsupported)")
        spans.append((start + len(header), len(after)))
    return spans


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_length: int) -> dict[str, list[int]]:
    """Tokenise ``messages`` with the tokenizer's own chat template; mask exactly the assistant tokens.

    Returns ``{"input_ids": [...], "loss_mask": [...]}`` truncated to ``max_length``. The mask covers each
    assistant turn's content and its end-of-turn token (not the role header, not the newline after the
    end-of-turn token, not system/user text). Needs a fast tokenizer (offset mapping). Raises
    :class:`TemplateError` when the template cannot be split into turns or the mask comes out all ones /
    all zeros for a conversation with assistant text.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError("tokenize_conversation needs a fast (Rust) tokenizer for offset mapping")
    full = _render(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"][:max_length])
    offsets = np.asarray(enc["offset_mapping"][: len(ids)], dtype=np.int64).reshape(-1, 2)  # [T, 2] chars
    stop_char = int(offsets[-1, 1]) if len(ids) else 0
    starts = offsets[:, 0]  # [T] first character of each token, non-decreasing
    mask = np.zeros(len(ids), dtype=np.int64)  # [T]
    end_ids = _end_of_turn_ids(tokenizer)
    spans = _assistant_spans(tokenizer, messages, full, stop_char)
    for lo_char, hi_char in spans:
        lo, hi = np.searchsorted(starts, lo_char, "left"), np.searchsorted(starts, hi_char, "left")
        turn = ids[lo:hi]
        ends = [j for j, t in enumerate(turn) if t in end_ids]
        if ends:  # stop at the end-of-turn token: what follows it (a newline) is template glue
            hi = lo + ends[-1] + 1
        mask[lo:hi] = 1
    if len(ids) and mask.all():
        raise TemplateError("loss mask covers every token; the chat template looks unsupported")
    if spans and any(s < stop_char for s, _ in spans) and not mask.any():
        raise TemplateError("loss mask is empty although the conversation has assistant text; the chat template "
                            "looks unsupported")
    return {"input_ids": ids, "loss_mask": mask.tolist()}


# --------------------------------------------------------------------------- datasets, packing, batching


class ChatDataset(Dataset):
    """Tokenised samples (dicts with ``input_ids`` and ``loss_mask``, lists or 1-D numpy arrays)."""

    def __init__(self, samples: Sequence[dict]):
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]

    @property
    def lengths(self) -> list[int]:
        """Token count of each sample."""
        return [len(s["input_ids"]) for s in self.samples]


class _Batches(Dataset):
    """Pre-built batches of a :class:`ChatDataset`: item ``i`` is the list of samples of batch ``i``.

    Used with ``DataLoader(batch_size=None)`` so that a distributed sampler splits whole batches.
    """

    def __init__(self, dataset: ChatDataset, batches: list[list[int]]):
        self.dataset, self.batches = dataset, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> list[dict]:
        return [self.dataset[i] for i in self.batches[index]]


def pack_samples(samples: Iterable[dict], max_length: int) -> list[dict]:
    """Greedily concatenate consecutive samples into rows of at most ``max_length`` tokens.

    Packed rows get an all-ones attention mask from :func:`collate`, so tokens attend ACROSS conversation
    boundaries (no position reset or block-diagonal mask). That is a mild approximation for distillation;
    use :func:`bucket_by_length` (the default) when exact per-conversation context matters.
    Rows hold numpy arrays; ``num_sequences`` records how many samples each row holds.
    """
    rows: list[dict] = []
    ids: list = []
    mask: list = []
    used = 0

    def flush() -> None:
        rows.append({"input_ids": np.concatenate(ids).astype(np.int64),  # [<= max_length]
                     "loss_mask": np.concatenate(mask).astype(np.int64), "num_sequences": len(ids)})

    for sample in samples:
        s_ids, s_mask = sample["input_ids"][:max_length], sample["loss_mask"][:max_length]
        if ids and used + len(s_ids) > max_length:
            flush()
            ids, mask, used = [], [], 0
        ids.append(np.asarray(s_ids))
        mask.append(np.asarray(s_mask))
        used += len(s_ids)
    if ids:
        flush()
    return rows


def bucket_by_length(lengths: Sequence[int], batch_size: int, seed: int = 0, window: int = 64) -> list[list[int]]:
    """Group indices into batches of similar length to limit padding (deterministic for a seed).

    Indices are shuffled, cut into windows of ``batch_size * window``, sorted by length inside each window
    and split into batches; the batch order is shuffled again.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    lengths = np.asarray(lengths)
    span = batch_size * window
    batches = []
    for lo in range(0, len(order), span):
        chunk = order[lo: lo + span]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i: i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(batch: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples into ``input_ids``, ``attention_mask`` and ``loss_mask``, each ``[B, T]`` long."""
    width = max(len(s["input_ids"]) for s in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
    for row, sample in enumerate(batch):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.as_tensor(np.asarray(sample["input_ids"]), dtype=torch.long)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.as_tensor(np.asarray(sample["loss_mask"]), dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


def _pad_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def mtbench_prompts(tokenizer: Any, turns: int = 1, path: str | Path | None = None) -> list[list[int]]:
    """MT-Bench questions rendered as single-turn chat prompts with ``add_generation_prompt=True``.

    ``turns=1`` gives the 80 first-turn questions (held-out eval prompts). ``turns=2`` adds each second-turn
    question as its own single-turn prompt (160 in all; they refer to an earlier answer that is absent,
    so use them for throughput, not quality).
    """
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns}")
    prompts = []
    for question in mtbench_questions(path):
        for text in question["turns"][:turns]:
            rendered = _render(tokenizer, [{"role": "user", "content": text}], generation_prompt=True)
            prompts.append(list(tokenizer(rendered, add_special_tokens=False)["input_ids"]))
    return prompts


# --------------------------------------------------------------------------- cache and DataModule


def _spec_identity(spec: str) -> dict:
    """What identifies the data source: a local file by absolute path, size and mtime."""
    path = Path(spec).expanduser()
    if spec.strip().lower() != "sharegpt" and path.is_file():
        stat = path.stat()
        return {"path": str(path.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns}
    return {"name": spec}


def tokenize_all(tokenizer: Any, conversations: Sequence[list[dict]], max_length: int) -> tuple[list[dict], dict]:
    """Tokenise conversations; drop (and count) the ones with no assistant token left after truncation."""
    samples, empty, failed, first_error = [], 0, 0, None
    start = time.perf_counter()
    for messages in conversations:
        try:
            sample = tokenize_conversation(tokenizer, messages, max_length)
        except TemplateError as err:
            failed, first_error = failed + 1, first_error or err
            continue
        if len(sample["input_ids"]) < 2 or not any(sample["loss_mask"]):
            empty += 1
            continue
        samples.append(sample)
    seconds = time.perf_counter() - start
    if not samples:
        raise first_error or ValueError("no conversation has assistant tokens within max_length")
    tokens = sum(len(s["input_ids"]) for s in samples)
    info = {"samples": len(samples), "tokens": tokens, "no_assistant_tokens": empty, "template_errors": failed,
            "seconds": round(seconds, 2)}
    logger.info("tokenised %d conversations -> %d samples, %d tokens in %.1f s (%.0f tokens/s)%s",
                len(conversations), len(samples), tokens, seconds, tokens / max(seconds, 1e-9),
                f"; {failed} failed: {first_error}" if failed else "")
    return samples, info


def save_samples(path: Path, samples: Sequence[dict], metadata: dict) -> None:
    """Write samples as flat arrays in one safetensors file (atomic: temp file, then rename)."""
    from safetensors.numpy import save_file

    lengths = np.asarray([len(s["input_ids"]) for s in samples], dtype=np.int64)  # [N]
    arrays = {
        "input_ids": np.concatenate([np.asarray(s["input_ids"], dtype=np.int32) for s in samples]),  # [sum N_i]
        "loss_mask": np.concatenate([np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples]),  # [sum N_i]
        "lengths": lengths,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(arrays, str(tmp), metadata={"draftsmith": json.dumps(metadata)})
    os.replace(tmp, path)


def load_samples(path: Path) -> tuple[list[dict], dict]:
    """Read samples written by :func:`save_samples` (returns samples and their metadata).

    Each sample holds numpy views into two flat arrays (int32 ids, uint8 mask): compact, and shared
    rather than copied by forked DataLoader workers.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        metadata = json.loads((handle.metadata() or {}).get("draftsmith", "{}"))
        ids, mask, lengths = (handle.get_tensor(k) for k in ("input_ids", "loss_mask", "lengths"))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    samples = [{"input_ids": ids[a:b], "loss_mask": mask[a:b]} for a, b in zip(bounds[:-1], bounds[1:])]
    return samples, metadata


class ChatDataModule(pl.LightningDataModule):
    """Chat conversations tokenised once (cached on disk as safetensors) and served as padded batches.

    The cache key hashes the data source, the tokenizer (name, vocabulary size, chat template),
    ``max_length`` and ``limit``. The train/val split is a seeded permutation. Training batches are length
    bucketed (:func:`bucket_by_length`) unless ``packing`` (see :func:`pack_samples` for its caveat).
    """

    def __init__(self, tokenizer: Any, spec: str, max_length: int, batch_size: int, num_workers: int = 0,
                 val_fraction: float = 0.02, limit: int | None = None, packing: bool = False, seed: int = 0,
                 cache_dir: str | Path | None = None):
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.tokenizer, self.spec, self.max_length = tokenizer, spec, max_length
        self.batch_size, self.num_workers, self.val_fraction = batch_size, num_workers, val_fraction
        self.limit, self.packing, self.seed = limit, packing, seed
        self.cache_dir = Path(cache_dir) if cache_dir is not None else assets.cache_dir() / "data"
        self.pad_id = _pad_id(tokenizer)
        self.report: dict = {}
        self.train_set: ChatDataset | None = None
        self.val_set: ChatDataset | None = None

    @property
    def cache_path(self) -> Path:
        """Where the tokenised samples of this configuration are cached."""
        template = self.tokenizer.chat_template or ""
        key = {"v": _CACHE_VERSION, "spec": _spec_identity(self.spec), "max_length": self.max_length,
               "limit": self.limit, "tokenizer": getattr(self.tokenizer, "name_or_path", ""),
               "vocab": len(self.tokenizer), "template": hashlib.sha256(template.encode()).hexdigest()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.cache_dir / f"chat-{digest}.safetensors"

    def samples(self) -> list[dict]:
        """All tokenised samples, from the cache or tokenised now (and cached)."""
        path = self.cache_path
        if path.is_file():
            samples, self.report = load_samples(path)
            logger.info("loaded %d tokenised samples from %s", len(samples), path)
            return samples
        conversations, read = load_conversations(self.spec, self.limit)
        samples, info = tokenize_all(self.tokenizer, conversations, self.max_length)
        self.report = {"read": read.__dict__, **info}
        save_samples(path, samples, self.report)
        logger.info("cached tokenised samples at %s", path)
        return load_samples(path)[0]  # same compact representation on first and later runs

    def prepare_data(self) -> None:
        """Tokenise and cache once (Lightning calls this on one process per node)."""
        self.samples()

    def setup(self, stage: str | None = None) -> None:
        """Split samples deterministically into train and validation sets."""
        if self.train_set is not None:
            return
        samples = self.samples()
        order = np.random.default_rng(self.seed).permutation(len(samples))
        n_val = min(len(samples) - 1, max(1, round(len(samples) * self.val_fraction))) if self.val_fraction else 0
        self.val_set = ChatDataset([samples[i] for i in order[:n_val]])
        self.train_set = ChatDataset([samples[i] for i in order[n_val:]])

    def _ordered_sampling(self, size: int) -> dict[str, Any]:
        """Keep the seeded order; under data parallelism deal item r, r+W, ... to rank r.

        Lightning's automatic distributed sampler reshuffles, which would break the property that W processes
        see the same global batches as one process with W-step gradient accumulation.
        """
        trainer = getattr(self, "trainer", None)
        world = int(getattr(trainer, "world_size", 1) or 1)
        if world <= 1:
            return {"shuffle": False}
        sampler = torch.utils.data.DistributedSampler(range(size), num_replicas=world, rank=int(trainer.global_rank),
                                                      shuffle=False, drop_last=False)
        return {"sampler": sampler}

    def _loader(self, dataset: Dataset, **kwargs: Any) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(dataset, num_workers=self.num_workers, generator=generator,
                          collate_fn=partial(collate, pad_id=self.pad_id), **kwargs)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches: packed rows, or length buckets (one item = one whole batch)."""
        if self.train_set is None:
            self.setup("fit")
        if self.packing:
            rows = ChatDataset(pack_samples(self.train_set.samples, self.max_length))
            order = np.random.default_rng(self.seed).permutation(len(rows))
            rows = ChatDataset([rows.samples[i] for i in order])
            return self._loader(rows, batch_size=self.batch_size, **self._ordered_sampling(len(rows)))
        batches = bucket_by_length(self.train_set.lengths, self.batch_size, seed=self.seed)
        # The order is already a seeded permutation; no loader shuffle, so a distributed sampler deals batch
        # r, r+W, ... to rank r and W processes see exactly the batches one process sees with W-step accumulation.
        return self._loader(_Batches(self.train_set, batches), batch_size=None, **self._ordered_sampling(len(batches)))

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        if self.val_set is None:
            self.setup("validate")
        return self._loader(self.val_set, batch_size=self.batch_size, shuffle=False)


def build_datamodule(cfg: Any, tokenizer: Any, packing: bool | None = None) -> ChatDataModule:
    """The data module a composed config asks for (``cfg.data`` and ``cfg.run.seed``); one place for every caller."""
    limit = cfg.data.limit
    return ChatDataModule(tokenizer=tokenizer, spec=str(cfg.data.spec), max_length=int(cfg.data.max_length),
                          batch_size=int(cfg.data.batch_size), num_workers=int(cfg.data.num_workers),
                          val_fraction=float(cfg.data.val_fraction), limit=int(limit) if limit else None,
                          packing=bool(cfg.data.packing) if packing is None else packing, seed=int(cfg.run.seed))
