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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.cache_costs import MANIFEST, build_cpu_seconds, record_build_cost
from draftsmith.common.errors import ConfigError
from draftsmith.distill.feature_cache.shards import (
    intact_shards,
    shard_damage,  # noqa: F401 - re-exported
    write_shard,
)
from draftsmith.distill.target.frozen import FeatureTaps

log = logging.getLogger(__name__)

FORMAT, VERSION = "draftsmith-features", 1
TARGET_DIR, HEAD_FILE = "target", "head.safetensors"
# batch keys that carry cached target features (stripped before the objective sees the batch)
PREFIX = "features."
SPLITS = ("train", "val")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class FeatureCacheError(ConfigError):
    """A feature cache cannot be written or used as asked (wrong config, incomplete folder, disk too
    small)."""


def cached_taps(taps: FeatureTaps) -> FeatureTaps:
    """What the cache stores for ``taps``: the hidden states asked for, plus ``final_hidden``
    (logits and top-k are rebuilt from it with the stored LM head); ``lazy_logits`` here means the
    target's greedy ids are stored too (an objective that reads logits lazily then never needs the
    whole [B, T, V] logits rebuilt)."""
    return FeatureTaps(
        final_hidden=True,
        prenorm_hidden=taps.prenorm_hidden,
        layers=tuple(sorted(set(taps.layers))),
        lazy_logits=bool(taps.logits and taps.lazy_logits),
    )


def taps_key(taps: FeatureTaps) -> dict[str, Any]:
    """The taps as the fingerprint and manifest record them (``lazy_logits`` only when set: caches
    written before it existed keep their fingerprint)."""
    return {k: v for k, v in asdict(taps).items() if k != "lazy_logits" or v}


def feature_names(taps: FeatureTaps) -> list[str]:
    """Names of the stored [B, T, H] features of ``taps`` (a :func:`cached_taps` result)."""
    return (
        ["final_hidden"] * taps.final_hidden
        + ["prenorm_hidden"] * taps.prenorm_hidden
        + [f"layer.{i}" for i in taps.layers]
    )


def bytes_per_token(
    n_features: int, hidden: int, dtype: torch.dtype, greedy_ids: bool = False
) -> int:
    """Bytes of one stored position: the features plus the int32 id, the two uint8 masks and, when
    stored, the int32 greedy id of the target."""
    return (
        n_features * hidden * torch.empty((), dtype=dtype).element_size()
        + 4
        + 1
        + 1
        + 4 * greedy_ids
    )


def settings_of(cfg: Any) -> dict[str, Any]:
    """The config that decides what a cache holds (checked again when training from it): recipe,
    target, data."""
    from draftsmith.distill.data.datamodule import _spec_identity

    d, name = cfg.data, str(cfg.target.name_or_path)
    if (
        Path(name).expanduser().exists()
    ):  # a local folder: the same whether named relatively or absolutely
        name = str(Path(name).expanduser().resolve())
    return {
        "recipe": str(cfg.recipe.name),
        "target": {"name_or_path": name},
        "data": {
            "spec": _spec_identity(str(d.spec)),
            "limit": d.limit,
            "max_length": int(d.max_length),
            "batch_size": int(d.batch_size),
            "packing": bool(d.packing),
            "val_fraction": float(d.val_fraction),
            "seed": int(cfg.run.seed),
        },
    }


def differences(cached: Any, now: Any, where: str = "") -> list[str]:
    """``key: cache X, now Y`` for every leaf that differs between two nested dicts."""
    if isinstance(cached, dict) and isinstance(now, dict):
        return [
            line
            for key in sorted(set(cached) | set(now), key=str)
            for line in differences(
                cached.get(key), now.get(key), f"{where}.{key}" if where else str(key)
            )
        ]
    return [] if cached == now else [f"{where}: cache {cached!r}, now {now!r}"]


def human(n: float) -> str:
    """``1.5 GB``-style byte count."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def plan_shards(batches: list[tuple[str, int, int]], bpt: int, shard_bytes: int) -> list[dict]:
    """Consecutive batches ``(split, index, positions)`` grouped into shards of about
    ``shard_bytes`` each."""
    shards: list[dict] = []
    for g, (_, _, positions) in enumerate(batches):
        if not shards or shards[-1]["bytes"] + positions * bpt > shard_bytes:
            shards.append(
                {
                    "file": f"shard-{len(shards):05d}.safetensors",
                    "start": g,
                    "stop": g,
                    "tokens": 0,
                    "bytes": 0,
                }
            )
        shard = shards[-1]
        shard["stop"], shard["tokens"], shard["bytes"] = (
            g + 1,
            shard["tokens"] + positions,
            shard["bytes"] + positions * bpt,
        )
    return shards


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
    from tqdm.auto import tqdm

    from draftsmith.distill.data.datamodule import build_chat_datamodule
    from draftsmith.distill.data.samples import collate
    from draftsmith.distill.engine.trainer import run_device
    from draftsmith.distill.target.frozen import Target

    if dtype not in DTYPES:
        raise FeatureCacheError(f"cache dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if recipe.validate is not None:
        recipe.validate(cfg)
    out = Path(out)
    device = run_device(cfg.trainer)
    if target is None:
        target = Target.load(
            cfg.target.name_or_path,
            cfg.target.dtype,
            device=device,
            trust_remote_code=bool(cfg.target.trust_remote_code),
        )
    taps = _resumable_format(out, _cacheable_taps(cfg, recipe, target))
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
    manifest = _new_manifest(out, cfg, taps, dtype, shard_bytes, names, target, bpt, plans, shards)
    done = intact_shards(out, shards)
    _check_disk_budget(out, manifest, done, target, dtype)
    if len(done) == len(shards) and old_complete(out):
        return json.loads((out / MANIFEST).read_text())
    _start_writing(out, manifest, target)
    first = plans[batches[0][0]]
    _check_logits(target, collate([first[0][j] for j in first[1][0]], data.pad_id), taps, device)
    bar = tqdm(
        total=manifest["tokens"],
        initial=sum(s["tokens"] for s in done),
        unit="tok",
        unit_scale=True,
        desc="cache-features",
    )
    written = 0
    for shard in shards:
        if shard in done:
            continue
        if stop_after is not None and written >= stop_after:
            bar.close()
            return manifest
        cpu = (
            time.process_time()
        )  # this process's CPU time, every thread: what a curve bills for the cache
        tensors, meta = _shard_tensors(
            target,
            taps,
            names,
            store,
            device,
            data.pad_id,
            plans,
            batches[shard["start"] : shard["stop"]],
            bar,
        )
        write_shard(out / shard["file"], tensors, meta)
        record_build_cost(out, shard["file"], time.process_time() - cpu)
        written += 1
    bar.close()
    return _finish(out, manifest)


def _finish(out: Path, manifest: dict) -> dict:
    """Mark the cache complete (its manifest, atomically) and log its size and what it cost to
    build."""
    manifest["complete"] = True
    _write_json(out / MANIFEST, manifest)
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
    _write_json(out / MANIFEST, manifest)
    _save_target(target, out)


def _cacheable_taps(cfg: Any, recipe: Any, target: Any) -> FeatureTaps:
    """The taps to cache for ``recipe``'s objective on ``target``; refuses an objective that
    computes its own target features or trains on other than chat batches."""
    from draftsmith.distill.engine.objective import batch_kind, has_own_features

    objective = recipe.build(cfg, target)
    if has_own_features(objective) or batch_kind(objective) != "chat":
        raise FeatureCacheError(
            f"recipe {cfg.recipe.name} computes its own target features or trains on "
            f"{batch_kind(objective)!r} batches: it cannot train from a feature cache"
        )
    return cached_taps(objective.taps)


def _resumable_format(out: Path, taps: FeatureTaps) -> FeatureTaps:
    """``taps``, without the stored greedy ids when ``out`` holds a cache begun before they existed
    (it resumes in its own format; training from it rebuilds the whole logits, as it did)."""
    manifest = out / MANIFEST
    if (
        taps.lazy_logits
        and manifest.is_file()
        and "lazy_logits" not in json.loads(manifest.read_text())["taps"]
    ):
        return replace(taps, lazy_logits=False)
    return taps


def _new_manifest(
    out: Path,
    cfg: Any,
    taps: FeatureTaps,
    dtype: str,
    shard_bytes: int,
    names: list[str],
    target: Any,
    bpt: int,
    plans: dict[str, Any],
    shards: list[dict],
) -> dict:
    """The (not yet complete) manifest of this cache; refuses when ``out`` holds a cache of another
    configuration."""
    import hashlib

    settings = settings_of(cfg)
    key = {
        "settings": settings,
        "taps": taps_key(taps),
        "dtype": dtype,
        "shard_bytes": int(shard_bytes),
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": (
            "sha256:" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        ),
        **key,
        "features": names,
        "hidden_size": target.hidden_size,
        "bytes_per_token": bpt,
        "target": target.identity(),
        "target_dtype": str(target.lm_head_weight.dtype).replace("torch.", ""),
        "batches": {s: len(plans[s][1]) for s in SPLITS},
        "shards": shards,
        # the non-padding tokens of each split, as training counts them (train/tokens)
        "nonpad_tokens": {
            s: sum(len(items[j]["input_ids"]) for b in plan for j in b)
            for s, (items, plan) in plans.items()
        },
        "tokens": sum(s["tokens"] for s in shards),
        "complete": False,
    }
    if (out / MANIFEST).is_file():
        old = json.loads((out / MANIFEST).read_text())
        if old.get("fingerprint") != manifest["fingerprint"]:
            diff = differences({k: old.get(k) for k in key}, key)
            raise FeatureCacheError(
                f"{out} holds a feature cache for another configuration ({'; '.join(diff)}); "
                "choose another --out or delete that folder"
            )
    return manifest


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
    target: Any,
    taps: FeatureTaps,
    names: list[str],
    store: torch.dtype,
    device: Any,
    pad_id: int,
    plans: dict[str, Any],
    batches: list[tuple[str, int, int]],
    bar: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """One shard's tensors (ids, masks and features of each of its ``batches``) and its metadata
    (each batch's sample indices); advances the progress ``bar`` by each batch's positions."""
    from draftsmith.distill.data.samples import collate

    tensors, meta = {}, {}
    for split, i, positions in batches:
        items, plan = plans[split]
        batch = collate([items[j] for j in plan[i]], pad_id)  # [B, T] each
        asked = (
            replace(taps, logits=True) if taps.lazy_logits else taps
        )  # the greedy ids come from the logits
        feats = target.features(
            batch["input_ids"].to(device), batch["attention_mask"].to(device), asked
        )
        name = f"{split}.{i}"
        if taps.lazy_logits:
            tensors[f"{name}.greedy_ids"] = feats.greedy().to("cpu", torch.int32)  # [B, T]
        tensors[f"{name}.input_ids"] = batch["input_ids"].to(torch.int32)
        tensors[f"{name}.attention_mask"] = batch["attention_mask"].to(torch.uint8)
        tensors[f"{name}.loss_mask"] = batch["loss_mask"].to(torch.uint8)
        for feature in names:
            value = (
                feats.layer_hidden[int(feature[6:])]
                if feature.startswith("layer.")
                else getattr(feats, feature)
            )
            tensors[f"{name}.{feature}"] = value.detach().to("cpu", store).contiguous()  # [B, T, H]
        meta[name] = [int(j) for j in plan[i]]
        bar.update(positions)
    return tensors, meta


def old_complete(out: Path) -> bool:
    """Whether ``out``'s manifest says the cache is complete."""
    try:
        return bool(json.loads((out / MANIFEST).read_text()).get("complete"))
    except (OSError, ValueError):
        return False
