"""``make gpu-check``: every GPU-facing claim of draftsmith, checked in one run, reported in one table.

Stages (each timed, each under its own time limit, each failure caught so that it cannot hide the others):

1. ``setup``: a target folder and a synthetic chat dataset. The converted SmolLM2-135M-Instruct target is used when
   it is already in draftsmith's cache; otherwise (the lent GPU machine cannot receive the 98 MB GGUF) a Llama of the
   same shapes with random weights, and an offline word-level tokenizer padded to the same 49,152 entries.
2. ``pytest-gpu``: the test suite's ``gpu``-marked tests (``pytest -m gpu``).
3. ``train:<recipe>``: every standalone recipe trains a few steps through ``train.py`` (``trainer=gpu``,
   bf16-mixed) and exports. On CUDA, ``strategy:<preset>``: EAGLE-3 under ``trainer=fsdp|deepspeed_zero2|
   deepspeed_zero3 trainer.devices=1`` (each strategy built and run on one GPU).
4. ``runtime-kernels``: the lean decoder with ``kernel_backend="torch"`` vs ``"triton"``: fp32 parity (logits of a
   prefill and of a tree-verify forward, greedy tokens) and the decode speed of each in the serving dtype.
5. ``bench:<recipe>``: HF ``generate`` vs runtime AR vs speculative decoding with each export, plus the fp32
   lossless check (greedy speculative == greedy AR).

``--device cpu --tiny`` runs the same stages on a tiny model on the CPU in under a minute (Triton through its
interpreter), which is how the CPU test suite proves this script's logic.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# SmolLM2-135M-Instruct's shapes (its config.json); initializer_range is its own too.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.041666666666666664)
# Four layers keep Triton's CPU interpreter quick; EAGLE-3 then needs explicit taps (TINY_TRAIN_EXTRA).
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, initializer_range=0.05)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "\n"]
WORDS = ("the a of to and in is it you that was for on are with as they be at one have this from or by word but "
         "what some we can out other were all there when up use your how said each which do their time if will "
         "way about many then them write would like so these long make thing see two has look more day could go "
         "come did number sound no most people my over know water than call first who may down side been now "
         "find hello world python code answer question please explain why fast slow tree draft token model").split()
PROMPTS = ("please explain why the tree is fast", "write python code for the answer",
           "what is the first word of the question", "how many people know the answer")
# A 4-layer target has no three distinct default EAGLE-3 taps (2, L//2, L-3).
TINY_TRAIN_EXTRA = {"eagle3": ["drafter.target_layers=[1,2,3]"]}
ACCEPTANCE_CAVEAT = ("random-weight target: parity and speed carry over to the real model, acceptance (tau) and "
                     "speedups do not")


@dataclass
class Plan:
    """Sizes and settings of one run (``--tiny`` shrinks all of them)."""

    device: str
    tiny: bool
    shape: dict
    train_steps: int
    max_length: int
    batch_size: int
    conversations: int
    new_tokens: int
    prompts: int
    save_dtype: str  # dtype the random target is written in
    target_dtype: str  # target.dtype while training
    speed_dtype: str  # serving dtype for timings
    trainer: list[str]
    speed_prompts: int  # prompts timed per kernel backend (Triton's CPU interpreter is slow)
    kernel_tokens: int  # greedy tokens per prompt in the kernel stage (parity and timings)
    repeats: int  # timed repeats of one forward

    @classmethod
    def make(cls, device: str, tiny: bool) -> Plan:
        """The plan for ``device`` (``cuda`` / ``cpu``), full-size or tiny."""
        cuda = device == "cuda"
        trainer = ["trainer=gpu"] if cuda else ["trainer=cpu", "trainer.precision=bf16-mixed"]
        return cls(device=device, tiny=tiny, shape=TINY_SHAPE if tiny else SMOLLM2_SHAPE,
                   train_steps=2 if tiny else 20, max_length=48 if tiny else 256, batch_size=4 if tiny else 8,
                   conversations=24 if tiny else 256, new_tokens=12 if tiny else 64, prompts=2 if tiny else 4,
                   save_dtype="bf16" if cuda and not tiny else "fp32", target_dtype="bf16" if cuda else "fp32",
                   speed_dtype="bf16" if cuda else "fp32", trainer=trainer,
                   speed_prompts=1 if tiny else 4, kernel_tokens=4 if tiny else 64, repeats=20 if cuda else 1)


@dataclass
class Context:
    """What stages share: the plan, folders, and results later stages build on."""

    plan: Plan
    out: Path
    work: Path
    log_path: Path
    fail_stages: set[str]
    random_target: bool = False  # build the random SmolLM2-shaped target even if the converted one is cached
    target_note: str = ""
    target: Path | None = None
    data: Path | None = None
    prompts: list[list[int]] = field(default_factory=list)
    exports: dict[str, Path] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    recipes: list[str] = field(default_factory=list)  # empty: every standalone recipe

    def log(self, text: str) -> None:
        """Append to the run's log file (subprocess outputs and tracebacks land here too)."""
        with self.log_path.open("a") as handle:
            handle.write(text.rstrip("\n") + "\n")


class StageTimeout(Exception):
    """A stage ran past its time limit."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise StageTimeout in the main thread after ``seconds`` (SIGALRM; a no-op where signals are unavailable)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise StageTimeout(f"ran past its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_stage(name: str, fn: Callable[[Context], dict], ctx: Context, limit: float) -> dict:
    """Run one stage; whatever it raises becomes a ``fail`` record so the next stage still runs.

    ``fn`` returns ``{"ok": bool, "numbers": {...}, "note": str}``; ``ok`` defaults to True.
    """
    record: dict[str, Any] = {"stage": name, "status": "fail", "seconds": 0.0, "numbers": {}, "note": "", "error": ""}
    start = time.perf_counter()
    ctx.log(f"===== stage {name} (limit {limit:.0f} s)")
    try:
        with time_limit(limit):
            if name in ctx.fail_stages:
                raise RuntimeError("injected failure (--fail-stage)")
            result = fn(ctx) or {}
        record["status"] = "pass" if result.get("ok", True) else "fail"
        record["numbers"] = result.get("numbers", {})
        record["note"] = result.get("note", "")
        record["error"] = result.get("error", "")
    except Exception as err:  # noqa: BLE001 - one stage's failure must not stop the others
        record["error"] = f"{type(err).__name__}: {err}"[:400]
        ctx.log(traceback.format_exc())
    record["seconds"] = round(time.perf_counter() - start, 2)
    ctx.log(f"===== {name}: {record['status']} in {record['seconds']} s {record['error']}")
    print(f"[gpu-check] {name}: {record['status'].upper()} ({record['seconds']} s) {record['error']}", flush=True)
    free_memory(ctx)
    return record


def free_memory(ctx: Context) -> None:
    """Drop cached models between stages so GPU memory does not pile up."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


# ---------------------------------------------------------------------------------------------------- setup


def build_tokenizer(vocab_size: int) -> Any:
    """A word-level ChatML tokenizer built in-process (works offline), padded to ``vocab_size`` entries so that
    its length equals the model's vocabulary like a real checkpoint's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + sorted(set(WORDS)) + [".", ",", "?", "!"]
    words += [f"<extra_{i}>" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.WhitespaceSplit()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
                                   bos_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast


def build_random_target(folder: Path, plan: Plan) -> None:
    """Save a random-weight Llama of ``plan.shape`` plus its tokenizer as an HF folder (skipped when present)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = folder / "gpu_check_target.json"
    wanted = json.dumps({"shape": plan.shape, "dtype": plan.save_dtype}, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted:
        return
    tokenizer = build_tokenizer(plan.shape["vocab_size"])
    torch.manual_seed(0)
    config = LlamaConfig(**plan.shape, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(torch.bfloat16 if plan.save_dtype == "bf16" else torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    marker.write_text(wanted)


def synthetic_conversations(n: int) -> list[dict]:
    """ShareGPT-style chats over WORDS; replies follow a fixed pattern so drafters have something to learn."""
    import random

    rng = random.Random(0)
    words = sorted(set(WORDS))
    out = []
    for _ in range(n):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + " ?"
        first = question.split()[0]
        reply = " ".join([first, "is", "the", "answer", "to", "the", "question", "."] * 3)
        out.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": reply}]})
    return out


def converted_target() -> Path | None:
    """The converted SmolLM2-135M-Instruct folder if it is already in draftsmith's cache (never converts here)."""
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
        ctx.target_note = f"random-weight {kind} + in-process word-level tokenizer ({plan.shape['vocab_size']} entries)"
    ctx.data = ctx.work / "chats.jsonl"
    ctx.data.write_text("\n".join(json.dumps(c) for c in synthetic_conversations(plan.conversations)) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(ctx.target), local_files_only=True)
    ctx.prompts = [encode_chat(tokenizer, text) for text in PROMPTS[: plan.prompts]]
    config = json.loads((ctx.target / "config.json").read_text())
    return {"numbers": {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
                        "vocab": config["vocab_size"], "conversations": plan.conversations,
                        "prompts": len(ctx.prompts)}, "note": ctx.target_note}


# ---------------------------------------------------------------------------------------------------- subprocesses


def run_logged(ctx: Context, cmd: list[str], limit: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repo with output captured into the log; a timeout becomes StageTimeout."""
    ctx.log("$ " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit,
                              env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    except subprocess.TimeoutExpired as err:
        ctx.log(str(err.stdout or "")[-20000:] + str(err.stderr or "")[-20000:])
        raise StageTimeout(f"subprocess ran past its {limit:.0f} s limit") from err
    ctx.log(proc.stdout[-20000:] + "\n" + proc.stderr[-20000:])
    return proc


def gpu_test_files() -> list[str]:
    """Test files that use the ``gpu`` marker (collecting only them keeps unrelated imports out of this stage)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / errors / skipped from a pytest junit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {"passed": passed, "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def stage_pytest(ctx: Context, limit: float) -> dict:
    """``pytest -m gpu`` on the files using the marker; on CUDA at least one test must pass (all skipped = broken)."""
    files = gpu_test_files()
    if not files:
        return {"ok": False, "error": "no test file uses the gpu marker"}
    xml = ctx.work / "pytest_gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
    proc = run_logged(ctx, cmd, limit)
    counts = junit_counts(xml) if xml.is_file() else {}
    bad = counts.get("failed", 0) + counts.get("errors", 0)
    ok = proc.returncode == 0 and bad == 0 and (ctx.plan.device != "cuda" or counts.get("passed", 0) > 0)
    note = ", ".join(files) + ("" if ctx.plan.device == "cuda" else " (no CUDA here: they skip)")
    error = "" if ok else f"pytest exit {proc.returncode}: " + (proc.stdout.strip().splitlines() or [""])[-1][:200]
    return {"ok": ok, "numbers": counts, "note": note, "error": error}


# ---------------------------------------------------------------------------------------------------- training


# Recipes that need an input beyond chat data (or make no drafter): not trained standalone by the GPU check.
NEEDS_INPUT = {"specdecpp": "drafter=EXPORT", "learn2pd": "trajectories", "adaptive_temperature": "rollouts",
               "diffusion_adapt": "makes a target, not a drafter"}


def recipe_names(only: list[str] | None = None) -> list[str]:
    """Recipes registered in ``draftsmith.recipes``, selectable as ``conf/recipe/<name>.yaml`` and trainable on chat
    data alone (``only``: just those, e.g. the CPU test's three)."""
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
    return [f"recipe={recipe}", f"target={ctx.target}", f"target.dtype={p.target_dtype}", f"data={ctx.data}",
            "data.limit=null", f"data.max_length={p.max_length}", f"data.batch_size={p.batch_size}",
            "data.val_fraction=0.1", *p.trainer, f"trainer.max_steps={p.train_steps}", "trainer.log_every_n_steps=1",
            "run.checkpoint_every=1000", "run.final_eval_batches=2", "run.resume=false", "optim.warmup_steps=0",
            f"hydra.run.dir={run_dir}", *(TINY_TRAIN_EXTRA.get(recipe, []) if p.tiny else [])]


def last_json(text: str) -> dict:
    """train.py's summary: the last JSON object on stdout that starts with its ``recipe`` field."""
    start = text.rfind('{\n  "recipe"')
    if start < 0:
        raise ValueError("no JSON summary on stdout")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def stage_train(ctx: Context, recipe: str, limit: float) -> dict:
    """``python train.py recipe=<recipe> ...`` for a few steps; the export feeds ``bench:<recipe>``."""
    if ctx.target is None:
        raise RuntimeError("setup failed: no target")
    run_dir = ctx.work / "train" / recipe
    proc = run_logged(ctx, [sys.executable, str(REPO / "train.py"), *train_overrides(ctx, recipe, run_dir)], limit)
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
    numbers = {"steps": summary.get("steps"), "fit_s": fit,
               "train_tok_per_s": round(summary.get("tokens", 0) / fit, 1) if fit else None,
               "loss": loss}
    ok = summary.get("steps") == ctx.plan.train_steps and recipe in ctx.exports and loss is not None
    return {"ok": ok, "numbers": numbers, "note": " ".join(ctx.plan.trainer),
            "error": "" if ok else "wrong step count, no export or no loss"}


STRATEGY_PRESETS = ("fsdp", "deepspeed_zero2", "deepspeed_zero3")


def stage_strategy(ctx: Context, preset: str, limit: float) -> dict:
    """A few EAGLE-3 steps under ``trainer=<preset> trainer.devices=1`` (builds and runs the strategy on one GPU)."""
    if ctx.target is None:
        raise RuntimeError("setup failed: no target")
    run_dir = ctx.work / "strategy" / preset
    overrides = [o for o in train_overrides(ctx, "eagle3", run_dir) if not o.startswith("trainer=")]
    proc = run_logged(ctx, [sys.executable, str(REPO / "train.py"), *overrides, f"trainer={preset}",
                            "trainer.devices=1"], limit)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "error": f"train.py exit {proc.returncode}: {tail[:300]}"}
    summary = last_json(proc.stdout)
    ok = summary.get("steps") == ctx.plan.train_steps
    return {"ok": ok, "numbers": {"steps": summary.get("steps"), "fit_s": summary.get("fit_seconds")},
            "note": f"trainer={preset} trainer.devices=1", "error": "" if ok else "wrong step count"}


# ---------------------------------------------------------------------------------------------------- runtime


def torch_dtype(name: str) -> Any:
    """``fp32`` / ``bf16`` -> torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def sync(device: str) -> None:
    """Wait for queued GPU work so wall-clock timings are real."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def decoder(ctx: Context, dtype: str, kernels: str) -> Any:
    """The lean decoder of the target on the check's device (cached per dtype and kernel backend)."""
    from draftsmith.runtime.target.loading import load_decoder

    key = f"decoder/{dtype}/{kernels}"
    if key not in ctx.cache:
        ctx.cache[key] = load_decoder(ctx.target, dtype=torch_dtype(dtype), device=ctx.plan.device, backend="lean",
                                      kernel_backend=kernels)
    return ctx.cache[key]


def random_tree_mask(nodes: int, seed: int = 0) -> Any:
    """A valid draft-tree mask [nodes, nodes]: random parents, each node sees itself and its ancestors."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    mask = torch.eye(nodes, dtype=torch.bool)
    for i in range(1, nodes):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def prefill_and_tree_logits(model: Any, prompt: list[int], nodes: int = 12) -> tuple[Any, Any]:
    """Logits of a prefill and of one tree-verify forward after it (what a speculative step runs)."""
    import torch

    dev = model.device
    cache = model.allocate_cache(len(prompt) + nodes)
    ids = torch.tensor(prompt, device=dev)
    with torch.inference_mode():
        pre = model.forward(ids, cache, logits_for="all").logits
        cache.commit(len(prompt))
        tree = torch.tensor([(prompt[i % len(prompt)] * 7 + i) % model.config.vocab_size for i in range(nodes)],
                            device=dev)
        mask = random_tree_mask(nodes).to(dev)
        depth = (mask.sum(-1) - 1).to(dev)
        out = model.forward(tree, cache, tree_mask=mask, positions=len(prompt) + depth, logits_for="all").logits
    return pre.float(), out.float()


def forward_ms(model: Any, prompt: list[int], tokens: int, device: str, repeats: int) -> float:
    """Median ms of one forward of ``tokens`` new tokens (causal) after ``prompt``."""
    import torch

    cache = model.allocate_cache(len(prompt) + tokens)
    ids = torch.tensor(prompt, device=model.device)
    new = torch.full((tokens,), int(prompt[-1]), device=model.device)
    times = []
    with torch.inference_mode():
        model.forward(ids, cache, logits_for="last")
        cache.commit(len(prompt))
        for _ in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            model.forward(new, cache, logits_for="all")
            sync(device)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def kernel_parity(ctx: Context) -> dict:
    """fp32: max |logit diff| torch vs triton (prefill, tree forward) and greedy tokens equal on every prompt."""
    from draftsmith.runtime.decoding.autoregressive import generate_ar

    ref, tri = decoder(ctx, "fp32", "torch"), decoder(ctx, "fp32", "triton")
    diff, same = 0.0, 0
    for prompt in ctx.prompts:
        for a, b in zip(prefill_and_tree_logits(ref, prompt), prefill_and_tree_logits(tri, prompt)):
            diff = max(diff, float((a - b).abs().max()))
        n = ctx.plan.kernel_tokens
        same += generate_ar(ref, prompt, n) == generate_ar(tri, prompt, n)
    if ctx.plan.speed_dtype != "fp32":  # free the fp32 pair; the timings below load the serving dtype
        for key in [k for k in ctx.cache if k.startswith("decoder/fp32/")]:
            del ctx.cache[key]
    return {"fp32_max_logit_diff": diff, "fp32_greedy_equal": f"{same}/{len(ctx.prompts)}",
            "ok": same == len(ctx.prompts) and diff < 1e-3}


def kernel_speed(ctx: Context) -> dict:
    """Serving dtype: AR tokens/s and one 16-token forward (a verify-sized step) with each kernel backend."""
    from draftsmith.bench.timing import compare_outputs, time_runtime_ar

    plan = ctx.plan
    dtype, numbers, outputs, prompts = plan.speed_dtype, {}, {}, ctx.prompts[: plan.speed_prompts]
    for kernels in ("torch", "triton"):
        model = decoder(ctx, dtype, kernels)
        ar = time_runtime_ar(model, prompts, plan.kernel_tokens)
        outputs[kernels] = ar["outputs"]
        numbers[f"{kernels}_ar_tok_per_s"] = round(ar["tokens_per_s"], 1)
        numbers[f"{kernels}_fwd16_ms"] = round(forward_ms(model, prompts[0], 16, plan.device, plan.repeats), 3)
    if dtype != "fp32":  # fp32 agreement is the parity check itself
        agree = compare_outputs(outputs["torch"], outputs["triton"])
        numbers[f"{dtype}_greedy_equal"] = f"{agree['identical']}/{agree['total']}"
    numbers["triton_vs_torch_ar"] = numbers["triton_ar_tok_per_s"] / numbers["torch_ar_tok_per_s"]
    return numbers


def stage_kernels(ctx: Context) -> dict:
    """Lean decoder, torch vs Triton kernels: fp32 parity decides pass/fail; the serving-dtype numbers are timings."""
    if ctx.target is None:
        raise RuntimeError("setup failed: no target")
    parity = kernel_parity(ctx)
    ok = parity.pop("ok")
    numbers = {**parity, **kernel_speed(ctx)}
    note = f"parity in fp32, timings in {ctx.plan.speed_dtype} (greedy agreement there is information only)"
    if ctx.plan.device == "cpu":
        note += "; triton through TRITON_INTERPRET=1"
    return {"ok": ok, "numbers": numbers, "note": note,
            "error": "" if ok else "torch and triton kernels disagree (fp32)"}


def hf_reference(ctx: Context, dtype: str) -> dict:
    """HF ``generate`` on the device (timed once per dtype; every recipe's bench reuses it)."""
    from draftsmith.bench.timing import time_hf_generate

    key = f"hf/{dtype}"
    if key not in ctx.cache:
        ctx.cache[key] = time_hf_generate(ctx.target, ctx.prompts, ctx.plan.new_tokens, dtype=torch_dtype(dtype),
                                          device=ctx.plan.device)
    return ctx.cache[key]


def runtime_ar(ctx: Context, dtype: str) -> dict:
    """Runtime AR greedy decoding (auto kernels), timed once per dtype."""
    from draftsmith.bench.timing import eos_ids_from_folder, time_runtime_ar

    key = f"ar/{dtype}"
    if key not in ctx.cache:
        ctx.cache[key] = time_runtime_ar(decoder(ctx, dtype, "auto"), ctx.prompts, ctx.plan.new_tokens,
                                         eos_ids=eos_ids_from_folder(ctx.target))
    return ctx.cache[key]


def speculative(ctx: Context, recipe: str, dtype: str) -> tuple[dict, list]:
    """Greedy speculative decoding with the recipe's export (auto kernels): timing dict and per-prompt results."""
    from draftsmith.bench.timing import eos_ids_from_folder, time_decode
    from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.drafting.base import build_proposer

    model = decoder(ctx, dtype, "auto")
    spec = SpeculativeDecoder(model, build_proposer(ctx.exports[recipe], model), GreedyVerifier("auto"),
                              kernels_backend="auto")
    eos, n, results = eos_ids_from_folder(ctx.target), ctx.plan.new_tokens, []

    def decode(prompt: list[int]) -> list[int]:
        results.append(spec.generate(prompt, n, eos_ids=eos))
        return results[-1].tokens

    timing = time_decode(decode, ctx.prompts, warmup=lambda: spec.generate(ctx.prompts[0], 4, eos_ids=eos))
    return timing, results


def stage_bench(ctx: Context, recipe: str) -> dict:
    """HF generate / runtime AR / speculative tokens/s and tau in the serving dtype; fp32 lossless check."""
    from draftsmith.bench.timing import compare_outputs

    if recipe not in ctx.exports:
        raise RuntimeError(f"no export: train:{recipe} did not produce one")
    dtype = ctx.plan.speed_dtype
    hf, ar = hf_reference(ctx, dtype), runtime_ar(ctx, dtype)
    sp, results = speculative(ctx, recipe, dtype)
    steps = sum(r.steps for r in results)
    tau = sum(sum(a + 1 for a in r.accepted_per_step) for r in results) / max(1, steps)
    spec32 = sp if dtype == "fp32" else speculative(ctx, recipe, "fp32")[0]
    lossless = compare_outputs(runtime_ar(ctx, "fp32")["outputs"], spec32["outputs"])
    vs_hf = compare_outputs(hf_reference(ctx, "fp32")["outputs"], spec32["outputs"])
    numbers = {"hf_tok_per_s": round(hf["tokens_per_s"], 1), "ar_tok_per_s": round(ar["tokens_per_s"], 1),
               "spec_tok_per_s": round(sp["tokens_per_s"], 1), "tau": round(tau, 3),
               "spec_vs_ar": round(sp["tokens_per_s"] / ar["tokens_per_s"], 2),
               "ar_vs_hf": round(ar["tokens_per_s"] / hf["tokens_per_s"], 2),
               "lossless_fp32_vs_ar": f"{lossless['identical']}/{lossless['total']}",
               "fp32_vs_hf_generate": f"{vs_hf['identical']}/{vs_hf['total']}"}
    for key in [k for k in ctx.cache if "/fp32" in k and k.startswith("decoder/")]:
        del ctx.cache[key]
    ok = lossless["all_identical"]
    return {"ok": ok, "numbers": numbers, "note": f"{dtype}, {len(ctx.prompts)} prompts x {ctx.plan.new_tokens} tokens",
            "error": "" if ok else f"greedy speculative != greedy AR in fp32: {lossless['first_mismatch']}"}


# ---------------------------------------------------------------------------------------------------- report


def stage_list(ctx: Context, limits: dict[str, float]) -> list[tuple[str, Callable[[Context], dict], float]]:
    """(name, function, time limit) of every stage, recipes listed from the registry."""
    stages: list[tuple[str, Callable[[Context], dict], float]] = [
        ("setup", stage_setup, limits["setup"]),
        ("pytest-gpu", lambda c: stage_pytest(c, limits["pytest"]), limits["pytest"] + 30)]
    try:
        recipes = recipe_names(ctx.recipes)
    except Exception as err:  # noqa: BLE001 - reported as its own failed stage
        recipes = []
        stages.append(("recipes", failing(err), 1.0))
    for r in recipes:
        stages.append((f"train:{r}", lambda c, r=r: stage_train(c, r, limits["train"]), limits["train"] + 30))
    if ctx.plan.device == "cuda":  # the sharding presets need a GPU (the CPU run checks them by inspection)
        for preset in STRATEGY_PRESETS:
            stages.append((f"strategy:{preset}", lambda c, p=preset: stage_strategy(c, p, limits["train"]),
                           limits["train"] + 30))
    stages.append(("runtime-kernels", stage_kernels, limits["runtime"]))
    for r in recipes:
        stages.append((f"bench:{r}", lambda c, r=r: stage_bench(c, r), limits["runtime"]))
    return stages


def failing(err: Exception) -> Callable[[Context], dict]:
    """A stage function that re-raises ``err`` (a problem found while listing the stages)."""

    def fn(ctx: Context) -> dict:
        raise err

    return fn


def fmt(value: Any) -> str:
    """Numbers compactly: floats to 4 significant digits (small diffs in scientific notation)."""
    if isinstance(value, float):
        return f"{value:.2e}" if value and abs(value) < 1e-2 else f"{value:.4g}"
    return str(value)


def markdown(report: dict) -> str:
    """The one table: every stage, pass/fail, seconds, numbers, note/error."""
    lines = [f"**gpu-check** on {report['device_name']} ({report['device']}{', tiny' if report['tiny'] else ''}): "
             f"{'ALL PASS' if report['ok'] else 'FAILED'} in {report['total_seconds']:.0f} s. "
             f"Target: {report['target']}. Note: {ACCEPTANCE_CAVEAT}.", "",
             "| stage | result | s | numbers | note |", "|---|---|---|---|---|"]
    for r in report["stages"]:
        numbers = ", ".join(f"{k}={fmt(v)}" for k, v in r["numbers"].items()) or "-"
        note = "; ".join(x for x in (r["error"], r["note"]) if x).replace("|", "/").replace("\n", " ") or "-"
        lines.append(f"| {r['stage']} | {r['status'].upper()} | {r['seconds']:.1f} | {numbers} | {note} |")
    return "\n".join(lines) + "\n"


def environment(device: str) -> dict:
    """Versions and the device name for the report header."""
    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or platform.machine())
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - report, do not fail
        triton_version = None
    return {"device_name": name, "torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (the CPU test uses this)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "outputs" / "gpu_check"),
                   help="folder for gpu_check.json / .md / .log (default $OUT, else outputs/gpu_check)")
    p.add_argument("--work", default=None, help="scratch folder for the target, data and runs (default OUT/../work)")
    p.add_argument("--target", default=None, help="use this HF folder as the target instead of building one")
    p.add_argument("--random-target", action="store_true",
                   help="use the random SmolLM2-shaped target even where the converted one is cached")
    p.add_argument("--fail-stage", action="append", default=[], help="make this stage fail (tests the isolation)")
    p.add_argument("--recipes", default=None, help="comma-separated recipes to train and bench (default: every "
                   "recipe that trains on chat data alone)")
    p.add_argument("--only", action="append", default=[], help="run only stages starting with this (repeatable)")
    p.add_argument("--stage-timeout", type=float, default=240.0, help="seconds per training / runtime stage")
    p.add_argument("--pytest-timeout", type=float, default=300.0, help="seconds for the gpu-marked tests")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Triton's CPU interpreter must be chosen before triton is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import torch

        torch.set_num_threads(1)  # tiny models run faster on one thread than on contended ones
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(os.environ.get("TMPDIR", "/tmp")) / "draftsmith_gpu_check"
    work.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_check.log"
    log_path.write_text("")
    ctx = Context(Plan.make(args.device, args.tiny), out, work, log_path, set(args.fail_stage),
                  random_target=args.random_target, target=Path(args.target) if args.target else None,
                  recipes=[r for r in args.recipes.split(",") if r] if args.recipes else [])
    limits = {"setup": 300.0, "pytest": args.pytest_timeout, "train": args.stage_timeout,
              "runtime": args.stage_timeout}
    start, env, records = time.perf_counter(), environment(args.device), []
    for name, fn, limit in stage_list(ctx, limits):
        if args.only and name != "setup" and not any(name.startswith(o) for o in args.only):
            continue
        records.append(run_stage(name, fn, ctx, limit))
        # Rewritten after every stage: an outer timeout still leaves the stages that finished.
        report = write_report(ctx, args, env, records, time.perf_counter() - start)
    print(markdown(report), flush=True)
    return 0 if report["ok"] else 1


def write_report(ctx: Context, args: argparse.Namespace, env: dict, records: list[dict], seconds: float) -> dict:
    """gpu_check.json and gpu_check.md in the output folder; returns the report."""
    report = {"device": args.device, "tiny": args.tiny, **env, "target": ctx.target_note,
              "caveat": ACCEPTANCE_CAVEAT, "ok": all(r["status"] == "pass" for r in records),
              "total_seconds": round(seconds, 1), "stages": records}
    (ctx.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (ctx.out / "gpu_check.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    sys.exit(main())
