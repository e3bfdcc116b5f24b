"""The sweep's world: every input the cases point at, built once in-process from tiny models (never
the hub).

``build(folder)`` writes, and returns as placeholders for the case table (``{T}``, ``{MED}``...):

* ``T``: a tiny random Llama with a ChatML tokenizer (tests/conftest.py's); ``T2``: the same with
  hidden size 32;
* ``MED`` / ``EA3``: a 2-head Medusa and an EAGLE-3 export for ``T``; ``SPEC``: the EAGLE-3 export
  in the speculators format; ``VLLM``: the Medusa export in the vLLM/TGI Medusa layout; ``RUN``: a
  run folder whose last.ckpt holds the Medusa export's weights;
* ``DATA``: 16 chat conversations (jsonl); ``PROMPTS``: 3 prompts (jsonl); ``BIN``: a binary file;
  ``EMPTY``: an empty folder;
* ``REMOTE``: ``T`` relabelled as a model whose code ships in the folder (``auto_map``, an unknown
  ``model_type``); importing that code writes the file ``MARK``, so a case can tell whether a
  command ran it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
WORLD_FILE = "world.json"
REMOTE_CODE = """
import os
from pathlib import Path

from transformers import LlamaConfig

Path(os.environ.get("SWEEP_MARKER", "{mark}")).write_text("the folder's own code ran")


class SweepConfig(LlamaConfig):
    model_type = "sweep_llama"
"""
PROMPT_TEXTS = (
    "hello world , what is the answer ?",
    "please explain the code",
    "write python code for me",
)


def _tests_on_path() -> None:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def _target(folder: Path, tokenizer, **overrides) -> Path:
    from conftest import build_tiny_llama

    build_tiny_llama(len(tokenizer), **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _remote(folder: Path, target: Path, mark: Path) -> Path:
    shutil.copytree(target, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="sweep_llama",
        architectures=["SweepForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_sweep.SweepConfig",
            "AutoModelForCausalLM": "modeling_sweep.SweepForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "configuration_sweep.py").write_text(REMOTE_CODE.replace("{mark}", str(mark)))
    (folder / "modeling_sweep.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_sweep import"
        " SweepConfig\n\n\nclass SweepForCausalLM(LlamaForCausalLM):\n    config_class ="
        " SweepConfig\n"
    )
    return folder


def _exports(world: Path, target_dir: Path, tokenizer) -> dict[str, Path]:
    from export_faults import run_folder_of
    from runtime_exports import medusa_export_for
    from test_speculators_export import export_eagle3
    from transformers import AutoModelForCausalLM

    from draftsmith.cli import main as cli
    from draftsmith.distill.target.frozen import Target
    from draftsmith.export.speculators import to_speculators

    medusa, _ = medusa_export_for(target_dir, tokenizer, world / "medusa")
    target = Target(AutoModelForCausalLM.from_pretrained(target_dir), tokenizer, str(target_dir))
    eagle3, _ = export_eagle3(target, world / "eagle3")
    spec = to_speculators(eagle3, world / "speculators", str(target_dir))
    if cli(["export", str(medusa), "--out", str(world / "medusa_vllm"), "--format", "medusa"]) != 0:
        raise RuntimeError("the sweep could not convert its Medusa export to the vLLM layout")
    run = run_folder_of(medusa, world / "run")
    return {"MED": medusa, "EA3": eagle3, "SPEC": spec, "VLLM": world / "medusa_vllm", "RUN": run}


def _files(world: Path) -> dict[str, Path]:
    from conftest import make_conversations

    data = world / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(16)))
    prompts = world / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPT_TEXTS))
    binary = world / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (world / "empty").mkdir()
    return {"DATA": data, "PROMPTS": prompts, "BIN": binary, "EMPTY": world / "empty"}


def build(world: Path) -> dict[str, str]:
    """Build the world in ``world`` (a fresh folder) and return its placeholders (also written to
    world.json)."""
    _tests_on_path()
    import torch
    from conftest import build_tiny_tokenizer

    torch.set_num_threads(1)
    world.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    mark = world / "remote_code_ran"
    target = _target(world / "target", tokenizer)
    places = {
        "W": world,
        "T": target,
        "T2": _target(world / "target_narrow", tokenizer, hidden_size=32),
        "MARK": mark,
        "REMOTE": _remote(world / "remote_target", target, mark),
        **_exports(world, target, tokenizer),
        **_files(world),
    }
    found = {k: str(v) for k, v in places.items()}
    (world / WORLD_FILE).write_text(json.dumps(found, indent=2))
    return found


def load_or_build(world: Path) -> dict[str, str]:
    """The placeholders of the world in ``world``, built first when it is missing or incomplete."""
    saved = world / WORLD_FILE
    if saved.is_file():
        return json.loads(saved.read_text())
    if world.exists():
        shutil.rmtree(world)
    return build(world)
