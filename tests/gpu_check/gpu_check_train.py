"""``tests/gpu_check/gpu_check.py``'s setup and training stages: the target and chat data
(``setup``), the ``gpu``-marked tests (``pytest-gpu``), a few steps of every standalone recipe
through ``train.py`` (``train:<recipe>``) and, on CUDA, EAGLE-3 under each sharding preset
(``strategy:<preset>``).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpu_check_core import (
    CHATML,
    NEEDS_INPUT,
    PROMPTS,
    REPO,
    SPECIALS,
    TINY_TRAIN_EXTRA,
    WORDS,
    Context,
    Plan,
    run_logged,
)

# -------------------------------------------------------------------------------------------- setup


def build_tokenizer(vocab_size: int) -> Any:
    """A word-level ChatML tokenizer built in-process (works offline), padded to ``vocab_size``
    entries so that its length equals the model's vocabulary like a real checkpoint's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + sorted(set(WORDS)) + [".", ",", "?", "!"]
    words += [f"<extra_{i}>" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    return fast


def build_random_target(folder: Path, plan: Plan) -> None:
    """Save a random-weight Llama of ``plan.shape`` plus its tokenizer as an HF folder (skipped when
    present)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = folder / "gpu_check_target.json"
    wanted = json.dumps({"shape": plan.shape, "dtype": plan.save_dtype}, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted:
        return
    tokenizer = build_tokenizer(plan.shape["vocab_size"])
    torch.manual_seed(0)
    config = LlamaConfig(
        **plan.shape,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(torch.bfloat16 if plan.save_dtype == "bf16" else torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    marker.write_text(wanted)


def synthetic_conversations(n: int) -> list[dict]:
    """ShareGPT-style chats over WORDS; replies follow a fixed pattern so drafters have something to
    learn."""
    import random

    rng = random.Random(0)
    words = sorted(set(WORDS))
    out = []
    for _ in range(n):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + " ?"
        first = question.split()[0]
        reply = " ".join([first, "is", "the", "answer", "to", "the", "question", "."] * 3)
        out.append(
            {
                "conversations": [
                    {"from": "human", "value": question},
                    {"from": "gpt", "value": reply},
                ]
            }
        )
    return out


def converted_target() -> Path | None:
    """The converted SmolLM2-135M-Instruct folder if it is already in draftsmith's cache (never
    converts here)."""
    from draftsmith import assets

    folder = assets.cache_dir() / "targets" / assets.TARGET_NAME
    return folder if (folder / ".complete").is_file() else None


def stage_setup(ctx: Context) -> dict:
    """Target folder, data jsonl and chat-encoded prompts."""
    from transformers import AutoTokenizer

    from draftsmith.common.chat import encode_chat

    plan = ctx.plan
    real = None if plan.tiny or ctx.random_target else converted_target()
    if ctx.target is not None:
        ctx.target_note = f"given target {ctx.target}"
    elif real is not None:
        ctx.target, ctx.target_note = real, f"real SmolLM2-135M-Instruct (converted, {real})"
    else:
        ctx.target = ctx.work / ("target_tiny" if plan.tiny else "target_smollm2_shape")
        build_random_target(ctx.target, plan)
        kind = "tiny Llama" if plan.tiny else "SmolLM2-135M shapes"
        ctx.target_note = (
            f"random-weight {kind} + in-process word-level tokenizer ({plan.shape['vocab_size']}"
            " entries)"
        )
    ctx.data = ctx.work / "chats.jsonl"
    ctx.data.write_text(
        "\n".join(json.dumps(c) for c in synthetic_conversations(plan.conversations)) + "\n"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(ctx.target), local_files_only=True)
    ctx.prompts = [encode_chat(tokenizer, text) for text in PROMPTS[: plan.prompts]]
    config = json.loads((ctx.target / "config.json").read_text())
    return {
        "numbers": {
            "layers": config["num_hidden_layers"],
            "hidden": config["hidden_size"],
            "vocab": config["vocab_size"],
            "conversations": plan.conversations,
            "prompts": len(ctx.prompts),
        },
        "note": ctx.target_note,
    }


# ------------------------------------------------------------------------------------------- pytest


def gpu_test_files() -> list[str]:
    """Test files that use the ``gpu`` marker (collecting only them keeps unrelated imports out of
    this stage)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / errors / skipped from a pytest junit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


def stage_pytest(ctx: Context, limit: float) -> dict:
    """``pytest -m gpu`` on the files using the marker; on CUDA at least one test must pass (all
    skipped = broken)."""
    files = gpu_test_files()
    if not files:
        return {"ok": False, "error": "no test file uses the gpu marker"}
    xml = ctx.work / "pytest_gpu.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        *files,
    ]
    proc = run_logged(ctx, cmd, limit)
    counts = junit_counts(xml) if xml.is_file() else {}
    bad = counts.get("failed", 0) + counts.get("errors", 0)
    ok = (
        proc.returncode == 0
        and bad == 0
        and (ctx.plan.device != "cuda" or counts.get("passed", 0) > 0)
    )
    note = ", ".join(files) + ("" if ctx.plan.device == "cuda" else " (no CUDA here: they skip)")
    error = (
        ""
        if ok
        else f"pytest exit {proc.returncode}: "
        + (proc.stdout.strip().splitlines() or [""])[-1][:200]
    )
    return {"ok": ok, "numbers": counts, "note": note, "error": error}


# ----------------------------------------------------------------------------------------- training


def recipe_names(only: list[str] | None = None) -> list[str]:
    """Recipes registered in ``draftsmith.recipes``, selectable as ``conf/recipe/<name>.yaml`` and
    trainable on chat data alone (``only``: just those, e.g. the CPU test's three)."""
    from draftsmith.recipes import RECIPES

    on_disk = {p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml")}
    names = sorted((set(RECIPES) & on_disk) - set(NEEDS_INPUT))
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"--recipes {unknown} not among the standalone recipes {names}")
        names = [n for n in names if n in only]
    return names


def train_overrides(ctx: Context, recipe: str, run_dir: Path) -> list[str]:
    """Hydra overrides for a few steps of ``recipe`` on the check's target and data."""
    p = ctx.plan
    return [
        f"recipe={recipe}",
        f"target={ctx.target}",
        f"target.dtype={p.target_dtype}",
        f"data={ctx.data}",
        "data.limit=null",
        f"data.max_length={p.max_length}",
        f"data.batch_size={p.batch_size}",
        "data.val_fraction=0.1",
        *p.trainer,
        f"trainer.max_steps={p.train_steps}",
        "trainer.log_every_n_steps=1",
        "run.checkpoint_every=1000",
        "run.final_eval_batches=2",
        "run.resume=false",
        "optim.warmup_steps=0",
        f"hydra.run.dir={run_dir}",
        *(TINY_TRAIN_EXTRA.get(recipe, []) if p.tiny else []),
    ]


def last_json(text: str) -> dict:
    """train.py's summary: the last JSON object on stdout that starts with its ``recipe`` field."""
    start = text.rfind('{\n  "recipe"')
    if start < 0:
        raise ValueError("no JSON summary on stdout")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def stage_train(ctx: Context, recipe: str, limit: float) -> dict:
    """``python train.py recipe=<recipe> ...`` for a few steps; the export feeds
    ``bench:<recipe>``."""
    if ctx.target is None:
        raise RuntimeError("setup failed: no target")
    run_dir = ctx.work / "train" / recipe
    proc = run_logged(
        ctx, [sys.executable, str(REPO / "train.py"), *train_overrides(ctx, recipe, run_dir)], limit
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "error": f"train.py exit {proc.returncode}: {tail[:300]}"}
    summary = last_json(proc.stdout)
    export = run_dir / "export"
    if (export / "config.json").is_file():
        ctx.exports[recipe] = export
    metrics = summary.get("metrics", {})
    loss = metrics.get("val/loss", metrics.get("train/loss"))
    fit = float(summary.get("fit_seconds") or 0)
    numbers = {
        "steps": summary.get("steps"),
        "fit_s": fit,
        "train_tok_per_s": round(summary.get("tokens", 0) / fit, 1) if fit else None,
        "loss": loss,
    }
    ok = summary.get("steps") == ctx.plan.train_steps and recipe in ctx.exports and loss is not None
    return {
        "ok": ok,
        "numbers": numbers,
        "note": " ".join(ctx.plan.trainer),
        "error": "" if ok else "wrong step count, no export or no loss",
    }


STRATEGY_PRESETS = ("fsdp", "deepspeed_zero2", "deepspeed_zero3")


def stage_strategy(ctx: Context, preset: str, limit: float) -> dict:
    """A few EAGLE-3 steps under ``trainer=<preset> trainer.devices=1`` (builds and runs the
    strategy on one GPU)."""
    if ctx.target is None:
        raise RuntimeError("setup failed: no target")
    run_dir = ctx.work / "strategy" / preset
    overrides = [o for o in train_overrides(ctx, "eagle3", run_dir) if not o.startswith("trainer=")]
    proc = run_logged(
        ctx,
        [
            sys.executable,
            str(REPO / "train.py"),
            *overrides,
            f"trainer={preset}",
            "trainer.devices=1",
        ],
        limit,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "error": f"train.py exit {proc.returncode}: {tail[:300]}"}
    summary = last_json(proc.stdout)
    ok = summary.get("steps") == ctx.plan.train_steps
    return {
        "ok": ok,
        "numbers": {"steps": summary.get("steps"), "fit_s": summary.get("fit_seconds")},
        "note": f"trainer={preset} trainer.devices=1",
        "error": "" if ok else "wrong step count",
    }
