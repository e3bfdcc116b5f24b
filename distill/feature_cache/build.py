"""Offline feature cache: run the frozen target once over the data, store the features a recipe
taps, train from them.

Folder layout (``draftsmith cache-features recipe=NAME --out DIR``)::

    DIR/manifest.json            fingerprint (recipe + target + data settings + taps + dtype),
                                 bytes per token, the shard plan and token count; ``complete``
                                 once every shard is written
    DIR/shard-00000.safetensors  whole batches: ``{split}.{i}.input_ids`` (int32) /
                                 ``attention_mask`` / ``loss_mask`` (uint8) [B, T] and
                                 ``{split}.{i}.{feature}`` [B, T, H] in the cache dtype; the
                                 sample indices of each batch are in the header metadata
    DIR/target/                  the target's HF config, tokenizer and ``head.safetensors``
                                 (embedding, LM head): all a recipe reads of the target besides
                                 its features

``final_hidden`` is always stored: the target's logits (EAGLE-3's teacher, validation agreement) are
rebuilt from it with the stored LM head, which is exact for targets whose LM head is a plain linear
layer (checked on the first batch; a target that post-processes its logits is refused). For an
objective that reads the logits lazily (``FeatureTaps.lazy_logits``: EAGLE-3) the target's greedy
ids are stored too (``{split}.{i}.greedy_ids``, int32 [B, T]), so a training step rebuilds only the
teacher rows it scores (the 8,192 draft-vocabulary logits of the scored positions) instead of all
[B, T, V]; storing the draft vocabulary's logits themselves would cost 16 kB a token in bf16 against
1.2 kB for the final hidden state. Padded positions are stored too (whole batches), so
``bytes_per_token`` counts padded positions: ``n_features * H * dtype size + 4 (id) + 1 + 1 (masks)
[+ 4 (greedy)]``. Each shard is written to a temporary name and renamed, so a re-run resumes after
the last complete shard; a shard whose size disagrees with its own header (a cut copy, a full disk)
is named, removed and written again by the re-run, and training refuses it by name instead of
reading it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.cache_costs import MANIFEST, build_cpu_seconds, record_build_cost
from draftsmith.distill.feature_cache.manifest import (
    DTYPES,
    HEAD_FILE,
    SPLITS,
    TARGET_DIR,
    FeatureCacheError,
    bytes_per_token,
    cacheable_taps,
    feature_names,
    human,
    new_manifest,
    old_complete,
    plan_shards,
    resumable_format,
    write_json,
)
from draftsmith.distill.feature_cache.shards import intact_shards, write_shard
from draftsmith.distill.target.features import FeatureTaps

log = logging.getLogger(__name__)


def _check_logits(
    target: Any, batch: dict[str, torch.Tensor], taps: FeatureTaps, device: Any
) -> None:
    """Refuse a target whose logits are not ``lm_head(final_hidden)`` (softcapping, scaling, a
    bias)."""
    ids, attn = batch["input_ids"][:1].to(device), batch["attention_mask"][:1].to(device)
    feats = target.features(ids, attn, FeatureTaps(final_hidden=True, logits=True))
    rebuilt = F.linear(feats.final_hidden, target.lm_head_weight)
    if not torch.allclose(
        rebuilt.float(),
        feats.logits.float(),
        rtol=1e-3,
        atol=1e-3 * feats.logits.abs().max().item(),
    ):
        raise FeatureCacheError(
            f"target {target.name_or_path} post-processes its logits (softcapping, scaling or a "
            "bias): the feature cache cannot rebuild them from hidden states; train online "
            "(without data.features)"
        )


def _save_target(target: Any, out: Path) -> None:
    """The target's config, tokenizer, embedding and LM head (atomic: temp folder, then rename)."""
    from safetensors.torch import save_file

    final = out / TARGET_DIR
    if (final / HEAD_FILE).is_file():
        return
    tmp = out / f".{TARGET_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    target.config.save_pretrained(tmp)
    target.tokenizer.save_pretrained(tmp)
    # clones: a tied embedding and LM head share storage, which safetensors refuses
    save_file(
        {
            "embed": target.embed_weight.detach().cpu().clone().contiguous(),
            "lm_head": target.lm_head_weight.detach().cpu().clone().contiguous(),
        },
        str(tmp / HEAD_FILE),
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


@dataclass
class CachePlan:
    """What a cache run writes: the taps stored and their feature names, the storage dtype, the
    data's batches per split (``plans``: ``(items, batches)``; ``batches``: ``(split, index,
    positions)`` in the order they are stored), the shards they are grouped into and the manifest
    describing all of it."""

    taps: FeatureTaps
    names: list[str]
    store: torch.dtype
    pad_id: int
    plans: dict[str, Any]
    batches: list[tuple[str, int, int]]
    shards: list[dict]
    manifest: dict


def build_cache(
    cfg: Any,
    recipe: Any,
    out: str | Path,
    dtype: str = "bf16",
    shard_bytes: int = 1 << 30,
    target: Any = None,
    stop_after: int | None = None,
) -> dict:
    """Run the target over the train and val batches of ``cfg`` and write the features ``recipe``
    taps into ``out``.

    Prints the disk budget before starting and refuses when the disk cannot hold it; resumes after
    the last complete shard of an earlier run with the same fingerprint. ``target`` skips loading
    one (tests); ``stop_after`` stops after that many new shards (tests of an interrupted run).
    Returns the manifest.
    """
    from draftsmith.distill.data.samples import collate
    from draftsmith.distill.engine.lightning_trainer import run_device

    if dtype not in DTYPES:
        raise FeatureCacheError(f"cache dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if recipe.validate is not None:
        recipe.validate(cfg)
    out = Path(out)
    device = run_device(cfg.trainer)
    target = _load_target(cfg, device) if target is None else target
    plan = _plan_cache(cfg, recipe, target, out, dtype, shard_bytes)
    done = intact_shards(out, plan.shards)
    _check_disk_budget(out, plan.manifest, done, target, dtype)
    if len(done) == len(plan.shards) and old_complete(out):
        return json.loads((out / MANIFEST).read_text())
    _start_writing(out, plan.manifest, target)
    items, batches = plan.plans[plan.batches[0][0]]
    _check_logits(target, collate([items[j] for j in batches[0]], plan.pad_id), plan.taps, device)
    if not _write_shards(out, plan, target, device, done, stop_after):
        return plan.manifest
    return _finish(out, plan.manifest)


def _load_target(cfg: Any, device: str) -> Any:
    """The frozen target of ``cfg`` on ``device``."""
    from draftsmith.distill.target.frozen import Target

    return Target.load(
        cfg.target.name_or_path,
        cfg.target.dtype,
        device=device,
        trust_remote_code=bool(cfg.target.trust_remote_code),
    )


def _plan_cache(
    cfg: Any, recipe: Any, target: Any, out: Path, dtype: str, shard_bytes: int
) -> CachePlan:
    """The taps, batches, shards and manifest of a cache of ``recipe`` on ``target`` in ``out``."""
    from draftsmith.distill.data.datamodule import build_chat_datamodule

    taps = resumable_format(out, cacheable_taps(cfg, recipe, target))
    names, store = feature_names(taps), DTYPES[dtype]
    bpt = bytes_per_token(len(names), target.hidden_size, store, taps.lazy_logits)
    data = build_chat_datamodule(cfg, target.tokenizer, packing=None)
    data.setup("fit")
    plans = {split: data.batch_plan(split) for split in SPLITS}
    batches = [
        (split, i, len(b) * max(len(items[j]["input_ids"]) for j in b))
        for split, (items, plan) in plans.items()
        for i, b in enumerate(plan)
    ]
    shards = plan_shards(batches, bpt, shard_bytes)
    manifest = new_manifest(out, cfg, taps, dtype, shard_bytes, names, target, bpt, plans, shards)
    return CachePlan(taps, names, store, data.pad_id, plans, batches, shards, manifest)


def _write_shards(
    out: Path, plan: CachePlan, target: Any, device: Any, done: list[dict], stop_after: int | None
) -> bool:
    """Write the planned shards not yet ``done``, recording each one's CPU cost; False when
    ``stop_after`` new shards stopped it early."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=plan.manifest["tokens"],
        initial=sum(s["tokens"] for s in done),
        unit="tok",
        unit_scale=True,
        desc="cache-features",
    )
    written = 0
    for shard in plan.shards:
        if shard in done:
            continue
        if stop_after is not None and written >= stop_after:
            bar.close()
            return False
        # this process's CPU time, every thread: what a curve bills for the cache
        cpu = time.process_time()
        batches = plan.batches[shard["start"] : shard["stop"]]
        tensors, meta = _shard_tensors(target, plan, device, batches, bar)
        write_shard(out / shard["file"], tensors, meta)
        record_build_cost(out, shard["file"], time.process_time() - cpu)
        written += 1
    bar.close()
    return True


def _finish(out: Path, manifest: dict) -> dict:
    """Mark the cache complete (its manifest, atomically) and log its size and what it cost to
    build."""
    manifest["complete"] = True
    write_json(out / MANIFEST, manifest)
    cpu = build_cpu_seconds(out, manifest["shards"])
    log.info(
        "feature cache complete: %s (%s, %s CPU-h to build)",
        out,
        human(manifest["bytes_per_token"] * manifest["tokens"]),
        "?" if cpu is None else f"{cpu / 3600:.3f}",
    )
    return manifest


def _start_writing(out: Path, manifest: dict, target: Any) -> None:
    """Clear an interrupted run's temp shards, write the (incomplete) manifest and save the target's
    head files."""
    for stale in out.glob(
        ".shard-*"
    ):  # a temp file of an interrupted run: never renamed, never complete
        stale.unlink()
    write_json(out / MANIFEST, manifest)
    _save_target(target, out)


def _check_disk_budget(
    out: Path, manifest: dict, done: list[dict], target: Any, dtype: str
) -> None:
    """Create ``out``, print what the cache needs (shards not yet ``done``, plus the target's
    embedding and LM head when not yet saved) against the free space, and refuse when it does not
    fit."""
    shards, bpt, names = manifest["shards"], manifest["bytes_per_token"], manifest["features"]
    need = sum(s["bytes"] for s in shards) - sum(s["bytes"] for s in done)
    if not (
        out / TARGET_DIR / HEAD_FILE
    ).is_file():  # + the embedding and LM head the stand-in target reads
        need += sum(
            w.numel() * w.element_size() for w in (target.embed_weight, target.lm_head_weight)
        )
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    ids = (
        "10 bytes of ids, masks and greedy ids"
        if manifest["taps"].get("lazy_logits")
        else "6 bytes of ids and masks"
    )
    print(
        f"feature cache {out}: {bpt} bytes/token ({len(names)} features x {target.hidden_size} x"
        f" {dtype} + {ids}) x {manifest['tokens']:,} tokens = {human(bpt * manifest['tokens'])} in"
        f" {len(shards)} shards; {len(done)} already written; needs {human(need)} (with the"
        f" target's embedding and LM head), {human(free)} free",
        flush=True,
    )
    if need > free:
        raise FeatureCacheError(
            f"the feature cache needs {human(need)} more but {out} has {human(free)} free; free "
            "space, pick another --out, or shrink the data (data.limit, data.max_length)"
        )


def _shard_tensors(
    target: Any, plan: CachePlan, device: Any, batches: list[tuple[str, int, int]], bar: Any
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """One shard's tensors (ids, masks and features of each of its ``batches``) and its metadata
    (each batch's sample indices); advances the progress ``bar`` by each batch's positions."""
    from draftsmith.distill.data.samples import collate

    taps, tensors, meta = plan.taps, {}, {}
    for split, i, positions in batches:
        items, order = plan.plans[split]
        batch = collate([items[j] for j in order[i]], plan.pad_id)  # [B, T] each
        # the greedy ids come from the logits
        asked = replace(taps, logits=True) if taps.lazy_logits else taps
        feats = target.features(
            batch["input_ids"].to(device), batch["attention_mask"].to(device), asked
        )
        name = f"{split}.{i}"
        if taps.lazy_logits:
            tensors[f"{name}.greedy_ids"] = feats.greedy().to("cpu", torch.int32)  # [B, T]
        tensors[f"{name}.input_ids"] = batch["input_ids"].to(torch.int32)
        tensors[f"{name}.attention_mask"] = batch["attention_mask"].to(torch.uint8)
        tensors[f"{name}.loss_mask"] = batch["loss_mask"].to(torch.uint8)
        for feature in plan.names:
            value = (
                feats.layer_hidden[int(feature[6:])]
                if feature.startswith("layer.")
                else getattr(feats, feature)
            )
            # [B, T, H]
            tensors[f"{name}.{feature}"] = value.detach().to("cpu", plan.store).contiguous()
        meta[name] = [int(j) for j in order[i]]
        bar.update(positions)
    return tensors, meta
