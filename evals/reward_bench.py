"""``draftsmith bench reward --controller A[,B] --prompts embedded:heldout``: the reward evaluation
of adaptive-temperature layers against every fixed temperature of the grid, then each layer's
overhead in tokens/s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.bench.controller import bench_controller, overhead_text
from draftsmith.common.errors import InputError


def layer_names(exports: list[str]) -> dict[str, str]:
    """``adaptive-<granularity>`` per export (a folder name is appended when two share a
    granularity)."""
    from draftsmith.export.format import read_config

    names: dict[str, str] = {}
    for export in exports:
        name = f"adaptive-{read_config(export)['architecture']['granularity']}"
        if name in names:
            name = f"{name}-{Path(export).resolve().parent.name}"
        names[name] = export
    return names


def _fingerprint(export: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(export).glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cmd_reward_bench(args: argparse.Namespace) -> int:
    """``bench [--controller A[,B]] --prompts embedded:heldout``: rewards of every fixed grid
    temperature and of each layer on the task (JSON, markdown, PNG in ``--out``), then each layer's
    overhead in tokens/s."""
    from draftsmith.common.chat import encode_chat
    from draftsmith.datagen.mixed_task import load_prompt_records
    from draftsmith.datagen.rewards import load_reward
    from draftsmith.datagen.rollout_sampling import eos_ids_of
    from draftsmith.evals.reward_eval import evaluate, reward_table

    exports = [e for e in (args.controller or "").split(",") if e.strip()]
    names, layers, grid = _layers_and_grid(exports, args.grid)
    target, tokenizer, model = _load_target(args.target, exports, names, layers)
    records = load_prompt_records(args.prompts, args.num_prompts)
    for r in records:
        r["ids"] = encode_chat(tokenizer, r["text"])
    reward_name = args.reward or "embedded"
    settings = {
        "target": str(target),
        "prompts": args.prompts,
        "samples": args.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens,
        "reward": reward_name,
        "seed": args.seed,
        "dtype": "fp32",
    }
    result = evaluate(
        model,
        records,
        {n: (h, _fingerprint(names[n])) for n, h in layers.items()},
        grid,
        load_reward(reward_name),
        reward_name,
        lambda t: tokenizer.decode(t, skip_special_tokens=True),
        args.samples_per_prompt,
        args.max_new_tokens,
        eos_ids_of(tokenizer, model),
        args.seed,
        args.out,
        settings,
    )
    result["controllers"] = names
    print(reward_table(result))
    result["overhead"] = _layer_overheads(args, names, records)
    if args.out:
        _write_reward_eval(result, Path(args.out))
    return 0


def _layers_and_grid(
    exports: list[str], grid_flag: str | None
) -> tuple[dict[str, str], dict[str, Any], list[float]]:
    """``(names -> export, names -> head, grid)``: the layers' one temperature grid (``--grid``
    must agree with theirs), the default grid without layers or flag."""
    from draftsmith.controllers.adaptive_temperature import (
        DEFAULT_GRID,
        AdaptiveTemperatureHead,
        check_grid,
    )

    names = layer_names(exports)
    layers = {name: AdaptiveTemperatureHead.from_export(e)[0] for name, e in names.items()}
    grids = {tuple(h.config.grid) for h in layers.values()}
    if grid_flag is not None:
        grids.add(check_grid([t for t in grid_flag.split(",") if t.strip()]))
    if len(grids) > 1:
        raise InputError(
            f"the controllers and --grid use different temperature grids {sorted(grids)}; bench"
            " them separately (or drop --grid)"
        )
    return names, layers, list(next(iter(grids))) if grids else list(DEFAULT_GRID)


def _load_target(
    target: str | None, exports: list[str], names: dict[str, str], layers: dict[str, Any]
) -> tuple[str, Any, Any]:
    """``(target, tokenizer, model)``: ``--target``, else the first layer's, else the embedded
    one, in fp32 (the dtype rollouts sample in); a layer that reads another hidden size is
    refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith import assets
    from draftsmith.export.format import read_config

    target = target or (
        read_config(exports[0])["target"]["name_or_path"] if exports else "smollm2-135m"
    )
    path = assets.resolve_target(target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, head in layers.items():
        if head.config.hidden_size != model.config.hidden_size:
            raise InputError(
                f"{names[name]} reads hidden size {head.config.hidden_size} but {target} has "
                f"{model.config.hidden_size}; bench it with the target it was trained on"
            )
    return target, tokenizer, model


def _layer_overheads(
    args: argparse.Namespace, names: dict[str, str], records: list[dict]
) -> dict[str, dict]:
    """Tokens/s with and without each layer (by name -> export) on the first ``--overhead-prompts``
    records' ids, in the runtime's serving dtype; printed per layer."""
    from draftsmith.runtime.serving import load_runtime

    overhead = {}
    for name, export in names.items():
        rt = load_runtime(
            None,
            args.target,
            args.dtype,
            args.kernels,
            args.verifier,
            args.temperature,
            linear_backend=args.linear_backend,
            controller=export,
        )
        overhead[name] = bench_controller(
            rt, [r["ids"] for r in records[: args.overhead_prompts]], args.max_new_tokens
        )
        print(
            f"{name}: {overhead[name]['tokens_per_s_with_layer']:.1f} tok/s with the layer,"
            f" {overhead[name]['tokens_per_s_without_layer']:.1f} replaying its temperatures"
            f" without it (overhead {overhead_text(overhead[name])})"
        )
    return overhead


def _write_reward_eval(result: dict, out: Path) -> None:
    """``reward_eval.json``, ``reward_eval.md`` and (where it can be drawn) ``reward_eval.png`` in
    ``out``."""
    from draftsmith.evals.reward_eval import plot, reward_table

    out.mkdir(parents=True, exist_ok=True)
    (out / "reward_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "reward_eval.md").write_text(reward_table(result))
    png = plot(result, out / "reward_eval.png")
    print(
        f"wrote {out / 'reward_eval.json'}, reward_eval.md" + (", reward_eval.png" if png else "")
    )
