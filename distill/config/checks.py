"""Checks a composed training config against its schema (distill/config/schema.py, recipes/<name>/)
before anything loads: keys the schema lacks (``+key=value`` gets past Hydra's struct mode, the
schema does not), values outside the range a field declares; a key the command line gives twice; and
the key listing ``train.py recipe=NAME --help`` prints.

Every message is one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from draftsmith.common.errors import ConfigError
from draftsmith.distill.config.schema import TrainConfig

# What Lightning's DDP launcher appends to this command line for each further process
# (lightning_fabric's _hydra_subprocess_cmd): the run folder again, the job name, no output subdir.
LIGHTNING_CHILD_SUFFIX = (
    re.compile(r"hydra\.run\.dir=.*"),
    re.compile(r"hydra\.job\.name=train_ddp_process_\d+"),
    re.compile(r"hydra\.output_subdir=null"),
)

_BOUNDS = (
    ("ge", ">=", lambda v, b: v >= b),
    ("gt", ">", lambda v, b: v > b),
    ("le", "<=", lambda v, b: v <= b),
    ("lt", "<", lambda v, b: v < b),
)


def schema_fields(
    schema: type, prefix: str = ""
) -> Iterator[tuple[str, dataclasses.Field, type | None]]:
    """Every field of a schema class as (dotted path, field, nested schema or None), groups
    expanded."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        nested = nested_schema(hints[f.name])
        yield f"{prefix}{f.name}", f, nested
        if nested is not None:
            yield from schema_fields(nested, f"{prefix}{f.name}.")


def nested_schema(hint: Any) -> type | None:
    """The dataclass a group field holds (``X`` or ``Optional[X]``), else None."""
    candidates = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_args(hint)
        else [hint]
    )
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


def leaf_paths(schema: type) -> list[str]:
    """The dotted keys a schema declares (groups included), e.g. ``heads``, ``heads.num_heads``."""
    return [path for path, _, _ in schema_fields(schema)]


def close_keys(key: str, known: list[str]) -> list[str]:
    """Declared keys that look like ``key``: by the whole path, else the same leaf under another
    group."""
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [
            k
            for k in known
            if difflib.SequenceMatcher(None, leaf, k.rsplit(".", 1)[-1]).ratio() >= 0.85
        ][:3]
    return close


def unknown_key_message(key: str, recipe: str, schema: type) -> str:
    """``heads.num_head is not a key of recipe=medusa; did you mean heads.num_heads? ...``"""
    close = close_keys(key, leaf_paths(schema))
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return (
        f"{key} is not a key of recipe={recipe}{hint} (python train.py recipe={recipe} --help lists"
        " its keys with their types, defaults and docs)"
    )


def allowed_text(meta: dict[str, Any]) -> str:
    """What a field allows, in words: ``>= 1, or null (all)``; '' when it declares nothing."""
    parts = [f"{sign} {meta[name]:g}" for name, sign, _ in _BOUNDS if name in meta]
    if "allowed" in meta:
        parts.append(meta["allowed"])
    if "choices" in meta:
        parts.append("one of " + ", ".join(meta["choices"]))
    if "length" in meta:
        parts.append(f"{meta['length']} values")
    text = " and ".join(parts)
    return f"{text}, or null ({meta['null']})" if "null" in meta and text else text


def value_problem(path: str, value: Any, meta: dict[str, Any]) -> str | None:
    """The message for a value outside its field's declared range, else None (null passes where it
    may be null)."""
    if value is None or not (set(meta) - {"doc", "null"}):
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = (
        "length" in meta
        and len(values) != meta["length"]
        or "check" in meta
        and not meta["check"](value)
    )
    if "choices" in meta:
        text = ("true" if value else "false") if isinstance(value, bool) else str(value).lower()
        bad = bad or text not in [str(choice).lower() for choice in meta["choices"]]
    for item in values if any(name in meta for name, _, _ in _BOUNDS) else []:
        try:
            number = float(item)
        except (TypeError, ValueError):  # text where a number belongs (an untyped key)
            number = math.nan
        bad = (
            bad
            or not math.isfinite(number)
            or not all(ok(number, meta[n]) for n, _, ok in _BOUNDS if n in meta)
        )
    if not bad:
        return None
    shown = list(values) if isinstance(value, (list, tuple)) else value
    return f"{path}={shown} is out of range: allowed {allowed_text(meta)} ({meta['doc']})"


def schema_problems(cfg: DictConfig) -> list[str]:
    """Keys the schema of ``cfg`` does not declare, and values outside their declared ranges."""
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):
        return []
    recipe = str(OmegaConf.select(cfg, "recipe.name", default="?"))
    problems: list[str] = []
    _walk(cfg, "", recipe, schema, problems)
    return problems


def _walk(node: DictConfig, prefix: str, recipe: str, root: type, problems: list[str]) -> None:
    schema = OmegaConf.get_type(node)
    declared = (
        {f.name: f for f in dataclasses.fields(schema)}
        if dataclasses.is_dataclass(schema)
        else None
    )
    for name in node.keys():
        path = f"{prefix}{name}"
        if declared is not None and name not in declared:
            problems.append(unknown_key_message(path, recipe, root))
            continue
        child = node._get_node(name)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            _walk(child, f"{path}.", recipe, root, problems)
        elif declared is not None and not child._is_missing():
            value = node[name]
            value = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
            message = value_problem(path, value, dict(declared[name].metadata))
            if message:
                problems.append(message)


def check_schema(cfg: DictConfig) -> None:
    """Raise one :class:`ConfigError` naming every undeclared key and out-of-range value of
    ``cfg``."""
    problems = schema_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def describe_keys(cfg: DictConfig) -> list[str]:
    """One line per key of ``cfg``'s schema, the recipe's own groups first: ``path: type = value doc
    [allowed]`` (``train.py recipe=NAME --help``). A group that is null (``trainer.fsdp`` outside
    trainer=fsdp) is one line.
    """
    schema = OmegaConf.get_type(cfg)
    shared = {f.name for f in dataclasses.fields(TrainConfig)}
    hints = {path: f for path, f, _ in schema_fields(schema)}
    rows = sorted(
        schema_fields(schema), key=lambda row: row[0].split(".", 1)[0] in shared
    )  # stable: own first
    lines, null_groups = [], []
    for path, f, nested in rows:
        if any(path.startswith(f"{g}.") for g in null_groups):
            continue
        try:
            node = OmegaConf.select(cfg, path, throw_on_missing=True)
        except MissingMandatoryValue:
            node = "??? (required)"
        if nested is not None and node is not None:
            continue  # its keys follow
        if nested is not None:
            null_groups.append(path)
        value = OmegaConf.to_container(node) if isinstance(node, (DictConfig, ListConfig)) else node
        allowed = allowed_text(dict(hints[path].metadata))
        lines.append(
            f"  {path}: {f.type} = {'null' if value is None else value}   "
            f" {f.metadata.get('doc', '')}" + (f" [{allowed}]" if allowed else "")
        )
    return lines


def repeated_override(overrides: list[str]) -> str | None:
    """The one-line refusal of a key given twice (``recipe=medusa recipe=hydra``: Hydra would
    silently keep one), else None. What Lightning's DDP launcher appends for a further process
    (:data:`LIGHTNING_CHILD_SUFFIX`) is not the user's: the first process checked the command line
    it was given."""
    tail = overrides[-len(LIGHTNING_CHILD_SUFFIX) :]
    if len(tail) == len(LIGHTNING_CHILD_SUFFIX) and all(
        p.fullmatch(a) for p, a in zip(LIGHTNING_CHILD_SUFFIX, tail)
    ):
        overrides = overrides[: -len(LIGHTNING_CHILD_SUFFIX)]
    seen: dict[str, str] = {}
    for arg in overrides:
        key, sep, _ = arg.partition("=")
        name = key.lstrip("+~")
        if sep and name in seen:
            return (
                f"{name} is given twice ({seen[name]}, {arg}): pass it once (a sweep over values is"
                f" -m {name}=a,b)"
            )
        seen.setdefault(name, arg)
    return None


def target_folder_problem(given: str) -> str | None:
    """A local folder given as the target that holds no model (a drafter export, a run folder, a
    converted layout): one line naming what it is, before anything loads. Aliases and names that are
    not folders go to the loader.
    """
    from draftsmith import assets
    from draftsmith.export.folder_kinds import folder_kind

    if assets.resolve_target(given) != given or not Path(given).expanduser().is_dir():
        return None
    found = folder_kind(Path(given).expanduser())
    if found.kind not in ("export", "converted", "speculators", "medusa-layout", "gguf", "run"):
        return None
    if found.kind == "export" and (found.config or {}).get("method") == "diffusion_adapt":
        return None  # an adapted block-diffusion model is a target
    return (
        f"target.name_or_path={given} is {found.label}, not a target model: pass the model folder"
        " it was trained for (or the embedded default, target=smollm2)"
    )
