"""The tokenised-sample cache and the LightningDataModule that serves chat batches to the
trainer."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from draftsmith import assets
from draftsmith.common.errors import ConfigError, DataError
from draftsmith.common.registry import Registry
from draftsmith.distill.data.conversations import load_conversations
from draftsmith.distill.data.packing import collate_packed, pack_rows, row_batches
from draftsmith.distill.data.resumable import (
    ResumableLoader,
    ResumableSampler,
    batches_done_in_epoch,
)
from draftsmith.distill.data.sample_cache import (
    DamagedCache,
    load_samples,
    pack_samples_arrays,
    save_samples,
    spec_identity,
    unpack_samples,
)
from draftsmith.distill.data.samples import (
    ChatDataset,
    PrebuiltBatches,
    TemplateError,
    bucket_by_length,
    collate,
    pad_id_of,
    tokenize_conversation,
)

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1


def tokenize_all(
    tokenizer: Any, conversations: Sequence[list[dict]], max_length: int
) -> tuple[list[dict], dict]:
    """Tokenise conversations; drop (and count) the ones with no assistant token left after
    truncation."""
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
        raise first_error or DataError(
            f"none of the {len(conversations)} conversation(s) has an assistant token "
            f"within the first {max_length} tokens (data.max_length); raise "
            "data.max_length or check the data"
        )
    tokens = sum(len(s["input_ids"]) for s in samples)
    info = {
        "samples": len(samples),
        "tokens": tokens,
        "no_assistant_tokens": empty,
        "template_errors": failed,
        "seconds": round(seconds, 2),
    }
    logger.info(
        "tokenised %d conversations -> %d samples, %d tokens in %.1f s (%.0f tokens/s)%s",
        len(conversations),
        len(samples),
        tokens,
        seconds,
        tokens / max(seconds, 1e-9),
        f"; {failed} failed: {first_error}" if failed else "",
    )
    return samples, info


class ChatDataModule(pl.LightningDataModule):
    """Chat conversations tokenised once (cached on disk as safetensors) and served as padded
    batches.

    The cache key hashes the data source, the tokenizer (name, vocabulary size, chat template),
    ``max_length`` and ``limit``. The train/val split is a seeded permutation. Training batches are
    length bucketed (:func:`bucket_by_length`) unless ``packing`` (bin-packed fixed rows,
    :mod:`draftsmith.distill.data.packing`).
    """

    def __init__(
        self,
        tokenizer: Any,
        spec: str,
        max_length: int,
        batch_size: int,
        num_workers: int = 0,
        val_fraction: float = 0.02,
        limit: int | None = None,
        packing: bool = False,
        seed: int = 0,
        cache_dir: str | Path | None = None,
    ):
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.tokenizer, self.spec, self.max_length = tokenizer, spec, max_length
        self.batch_size, self.num_workers, self.val_fraction = batch_size, num_workers, val_fraction
        self.limit, self.packing, self.seed = limit, packing, seed
        self.cache_dir = Path(cache_dir) if cache_dir is not None else assets.cache_dir() / "data"
        self.pad_id = pad_id_of(tokenizer)
        self.report: dict = {}
        self.train_set: ChatDataset | None = None
        self.val_set: ChatDataset | None = None
        # warm start: steps of this data order earlier runs took (distill/engine/warm_start.py)
        self.step_offset = 0

    @property
    def cache_path(self) -> Path:
        """Where the tokenised samples of this configuration are cached."""
        template = self.tokenizer.chat_template or ""
        key = {
            "v": _CACHE_VERSION,
            "spec": spec_identity(self.spec, with_path=False),
            "max_length": self.max_length,
            "limit": self.limit,
            "tokenizer": getattr(self.tokenizer, "name_or_path", ""),
            "vocab": len(self.tokenizer),
            "template": hashlib.sha256(template.encode()).hexdigest(),
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.cache_dir / f"chat-{digest}.safetensors"

    def samples(self) -> list[dict]:
        """All tokenised samples, from the cache or tokenised now (and cached)."""
        path = self.cache_path
        if path.is_file():
            try:
                samples, self.report = load_samples(path)
            # verified on read: a damaged file is rebuilt, never read again
            except DamagedCache as err:
                logger.warning(
                    "the tokenised-data cache %s is damaged (%s): tokenising the data again",
                    path,
                    err,
                )
                path.unlink(missing_ok=True)
            else:
                logger.info("loaded %d tokenised samples from %s", len(samples), path)
                return samples
        conversations, read = load_conversations(self.spec, self.limit)
        samples, info = tokenize_all(self.tokenizer, conversations, self.max_length)
        self.report = {"read": read.__dict__, **info}
        if save_samples(path, samples, self.report):
            logger.info("cached tokenised samples at %s", path)
        return unpack_samples(
            pack_samples_arrays(samples)
        )  # the compact representation a cached run reads

    def prepare_data(self) -> None:
        """Tokenise and cache once (Lightning calls this on one process per node)."""
        self.samples()

    def setup(self, stage: str | None = None) -> None:
        """Split samples deterministically into train and validation sets."""
        if self.train_set is not None:
            return
        samples = self.samples()
        order = np.random.default_rng(self.seed).permutation(len(samples))
        n_val = (
            min(len(samples) - 1, max(1, round(len(samples) * self.val_fraction)))
            if self.val_fraction
            else 0
        )
        self.val_set = ChatDataset([samples[i] for i in order[:n_val]])
        self.train_set = ChatDataset([samples[i] for i in order[n_val:]])

    def _batches_done(self) -> int:
        trainer = self.trainer
        return batches_done_in_epoch(
            trainer.global_step + self.step_offset,
            trainer.num_training_batches,
            trainer.accumulate_grad_batches,
        )

    def _loader(
        self,
        dataset: Dataset,
        loader: type[DataLoader] = DataLoader,
        collate_fn: Any = None,
        **kwargs: Any,
    ) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        # no re-fork at each epoch / validation
        workers = {"persistent_workers": True} if self.num_workers else {}
        return loader(
            dataset,
            num_workers=self.num_workers,
            generator=generator,
            pin_memory=torch.cuda.is_available(),
            collate_fn=collate_fn or partial(collate, pad_id=self.pad_id),
            **workers,
            **kwargs,
        )

    def _train_layout(self) -> tuple[Dataset, int | None]:
        """The training dataset and its loader batch size: packed rows in a seeded order
        (``batch_size`` rows a batch), or length buckets where one item is one whole batch
        (``None``)."""
        if self.train_set is None:
            self.setup("fit")
        # fixed [batch_size, max_length] rows of bin-packed conversations (distill/data/packing.py)
        if self.packing:
            rows = ChatDataset(pack_rows(self.train_set.samples, self.max_length, seed=self.seed))
            return PrebuiltBatches(rows, row_batches(len(rows), self.batch_size)), None
        # The order is already a seeded permutation; no loader shuffle, so the sampler deals batch
        # r, r+W, ... to rank r and W processes see exactly the batches one process sees with W-step
        # accumulation.
        batches = bucket_by_length(self.train_set.lengths, self.batch_size, seed=self.seed)
        return PrebuiltBatches(self.train_set, batches), None

    def batch_plan(self, split: str) -> tuple[list[dict], list[list[int]]]:
        """``(items, batches)`` of ``split`` ("train" | "val"): the items (samples, or packed rows)
        and the item indices of each batch, in the order the split's loader serves them to one
        process from the start. The offline feature cache
        (:mod:`draftsmith.distill.feature_cache.build`) stores exactly these batches.
        """
        if split == "train":
            dataset, batch_size = self._train_layout()
            if batch_size is None:
                return dataset.dataset.samples, [list(b) for b in dataset.batches]
            items = dataset.samples
        else:
            if self.val_set is None:
                self.setup("validate")
            items, batch_size = self.val_set.samples, self.batch_size
        return items, [
            list(range(a, min(a + batch_size, len(items))))
            for a in range(0, len(items), batch_size)
        ]

    def train_dataloader(self) -> DataLoader:
        """Training batches in a fixed seeded order (packed rows, or length buckets with one item =
        one batch), resumable mid-epoch (see :mod:`draftsmith.distill.data.resumable`)."""
        dataset, batch_size = self._train_layout()
        packed = partial(
            collate_packed,
            row_length=self.max_length,
            pad_id=self.pad_id,
            rows_per_batch=self.batch_size,
        )
        loader = self._loader(
            dataset,
            ResumableLoader,
            collate_fn=packed if self.packing else None,
            batch_size=batch_size,
            sampler=ResumableSampler.for_trainer(len(dataset), getattr(self, "trainer", None)),
            batches_done=self._batches_done,
            items_per_batch=batch_size or 1,
        )
        if self.step_offset:  # a warm start goes on where its export's training left the data order
            from draftsmith.distill.engine.warm_start import continue_data_order

            continue_data_order(loader, self.step_offset, self.trainer.accumulate_grad_batches)
        return loader

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        if self.val_set is None:
            self.setup("validate")
        return self._loader(self.val_set, batch_size=self.batch_size, shuffle=False)


DATAMODULES: Registry[Callable[..., Any]] = Registry("batch kind")
# @register_batch_kind(name) on fn(cfg, tokenizer, packing) -> datamodule
register_batch_kind = DATAMODULES.register


def build_datamodule(
    cfg: Any, tokenizer: Any, packing: bool | None = None, kind: str = "chat"
) -> Any:
    """The data module of batch kind ``kind`` (an objective's ``batch_kind``) for a composed config
    (``cfg.data``, ``cfg.run.seed``); one place for every caller. Raises ValueError naming the
    registered kinds for an unknown one.
    """
    build = DATAMODULES.get(kind)  # an unknown kind fails first, naming the registered ones
    data = getattr(cfg, "data", None)
    if data is not None and data.get(
        "features"
    ):  # offline: the batches and target features come from a cache
        from draftsmith.distill.feature_cache.cached_data import cached_datamodule

        return cached_datamodule(cfg, kind)
    return build(cfg, tokenizer, packing)


@register_batch_kind("chat")
def build_chat_datamodule(cfg: Any, tokenizer: Any, packing: bool | None = None) -> ChatDataModule:
    """Chat conversations -> token ids + assistant loss masks (``cfg.data``)."""
    limit, rows = cfg.data.limit, rows_per_step(cfg.data)
    return ChatDataModule(
        tokenizer=tokenizer,
        spec=str(cfg.data.spec),
        max_length=int(cfg.data.max_length),
        batch_size=rows or int(cfg.data.batch_size),
        num_workers=int(cfg.data.num_workers),
        val_fraction=float(cfg.data.val_fraction),
        limit=int(limit) if limit else None,
        packing=bool(rows or cfg.data.packing) if packing is None else packing,
        seed=int(cfg.run.seed),
    )


def rows_per_step(data_cfg: Any) -> int | None:
    """Packed rows per batch when ``data.tokens_per_step`` sets the batch in tokens
    (``tokens_per_step // max_length``, at least 1), else None (``data.batch_size`` rows)."""
    tokens = data_cfg.get("tokens_per_step")
    return max(1, int(tokens) // int(data_cfg.max_length)) if tokens else None
