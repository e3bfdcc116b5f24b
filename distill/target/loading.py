"""Loading the frozen target: the dtype it runs in (``auto`` resolved for the device), the checks
of a local model folder before transformers reads it (a missing folder, a corrupt ``config.json``,
a truncated ``*.safetensors``, each named in one line), and the HF causal LM and tokenizer
themselves (:func:`load_causal_lm`, which :meth:`~draftsmith.distill.target.frozen.Target.load`
wraps).

``dtype="auto"`` (the default config) runs the target in bf16 where the device computes bf16
natively (CUDA with bf16, x86 with AVX512-BF16/AMX) and in fp32 elsewhere: emulated bf16 is several
times slower than fp32 (an AVX2-only EPYC ran the target forward at 80 tok/s in bf16 against 488
tok/s in fp32).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import ConfigError
from draftsmith.kernels import cpu_caps

log = logging.getLogger(__name__)


def resolve_target_dtype(
    name: str | torch.dtype, device: str | torch.device, caps: cpu_caps.CpuCaps | None = None
) -> tuple[torch.dtype, str]:
    """``target.dtype`` -> (torch dtype, why) for the device the target runs on; ``auto`` asks
    :func:`draftsmith.kernels.cpu_caps.resolve_dtype` (bf16 only where the device computes it
    natively).
    """
    if isinstance(name, torch.dtype):
        return name, f"{name} (as passed)"
    try:
        return cpu_caps.resolve_dtype(str(name), device, caps)
    except ValueError as err:
        raise ConfigError(f"target.dtype: {err}") from None


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path rather than a hub id (``org/name``): absolute,
    ``./``, ``~``, a Windows drive, or more than one ``/``."""
    return (
        name.startswith(("/", ".", "~", "\\"))
        or (len(name) > 1 and name[1] == ":")
        or name.count("/") > 1
        or Path(name).expanduser().exists()
    )


def check_safetensors(file: Path) -> str | None:
    """Why ``file`` is not a complete safetensors file (a truncated download, ...), or None; reads
    its header only."""
    from draftsmith.common.safetensors_check import safetensors_problem

    return safetensors_problem(file)


def check_target_folder(path: str) -> bool:
    """Refuse a target that names a missing local folder, or a folder with a corrupt ``config.json``
    or a truncated ``*.safetensors`` (naming the file), before transformers reports it in a long
    traceback. True when ``path`` is a local folder."""
    import json

    folder = Path(path).expanduser()
    if not folder.is_dir():
        if looks_like_path(path):
            what = "is a file, not a model folder" if folder.exists() else "does not exist"
            raise ConfigError(
                f"target.name_or_path={path}: {what}; point target= at a HF causal-LM folder "
                "(config.json, tokenizer, weights) or use the default smollm2-135m"
            )
        return False
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"target folder {folder} has no config.json: is it a Hugging Face model folder?"
        )
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"target file {config} is not valid JSON ({err}); the folder is damaged: re-download "
            "or re-save the model"
        ) from None
    for file in sorted(folder.glob("*.safetensors")):
        problem = check_safetensors(file)
        if problem:
            raise ConfigError(
                f"target file {file} is damaged: {problem}; re-download or re-save the model"
            )
    return True


def load_causal_lm(
    name_or_path: str,
    dtype: str | torch.dtype,
    runs_on: str | torch.device,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """The HF causal LM (in the dtype resolved for ``runs_on``, logged with its reason) and its
    tokenizer; a folder or name that does not load is refused in one line (:func:`load_error`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.assets import resolve_target
    from draftsmith.common.remote_code import refuse_remote_code

    torch_dtype, why = resolve_target_dtype(dtype, runs_on)
    log.info("target dtype: %s", why)
    path = resolve_target(name_or_path)
    local = check_target_folder(path)
    if local:  # one line naming the opt-in, before transformers' three (common/remote_code.py)
        refuse_remote_code(path, trust_remote_code, "target.trust_remote_code=true")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except Exception as err:
        problem = load_error(err, name_or_path, path, local)
        if problem is None:
            raise
        raise problem from err
    log.info(
        "target %s loaded (%s, %.1fM params)",
        path,
        torch_dtype,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model, tokenizer


def load_error(err: Exception, name_or_path: str, path: str, local: bool) -> ConfigError | None:
    """The one-line error for a target that transformers could not load: a folder or hub name that
    is not a model (``OSError``/``ValueError``), or a damaged local folder (safetensors' own errors
    and the like). None: raise ``err`` as it is (one of ours already, or an unexpected error from a
    hub name)."""
    if isinstance(err, ConfigError):
        return None
    if isinstance(err, (OSError, ValueError)):
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        where = (
            f"target folder {path}"
            if local
            else (
                f"target.name_or_path={name_or_path!r} is not a local folder and loading it"
                " from the Hugging Face hub failed"
            )
        )
        return ConfigError(
            f"{where}: {first} (point target= at a HF causal-LM folder with config.json,"
            " tokenizer and weights, or use the default smollm2-135m)"
        )
    if not local:
        return None
    return ConfigError(
        f"target folder {path} could not be loaded: {type(err).__name__}: "
        f"{str(err).strip()[:300]}; re-download or re-save it"
    )
