"""Convert a draftsmith EAGLE-3 or DFlash export into llama.cpp GGUF files: the target (BF16,
optionally quantised) and the drafter, through llama.cpp's own ``convert_hf_to_gguf.py`` (never a
re-implementation of its writer).

Run with the tool ``make llamacpp`` builds: ``bin/llama-speculative-simple -m OUT/target-bf16.gguf
-md OUT/draft.gguf --spec-type draft-eagle3 -p PROMPT`` (``draft-dflash`` for DFlash;
``gguf.json``'s ``run`` has the command; ``draftsmith engine-check`` runs it and checks it). ``make
llamacpp`` builds no ``llama-server`` (scripts/build_llamacpp.sh configures with
``LLAMA_BUILD_SERVER=OFF``): to serve over HTTP, give a llama.cpp build that has ``llama-server``
the same ``-m``/``-md``/``--spec-type`` flags (``gguf.json``'s ``serve``).

``draft.gguf``'s ``general.name`` comes from the folder the converter reads (the draft has no
``_name_or_path``): it is named ``draftsmith-<method>-drafter``, never after a temporary folder.

DFlash: the converter is given the z-lab layout (``export/dflash.py``: ``DFlashDraftModel``,
``dflash_config.target_layer_ids`` = draftsmith ``target_layers - 1``; the converter writes
``target_layers`` = ``target_layer_ids + 1`` into the GGUF and llama.cpp captures the input of those
target layers, i.e. the same ``hidden_states`` draftsmith trained on), with ``--target-model-dir``
for the vocabulary. No embedding and no LM head: llama.cpp's DFlash draft takes the target's. Its
block is ``n_max + 1`` tokens (``--spec-draft-n-max``) and attention inside the block is non-causal,
so drafts equal the trained ones only at ``n_max = block_size - 1`` (``gguf.json``'s
``draft_n_max``).

Which layout the converter is given: the speculators one (``Eagle3Speculator``: top-level
``eagle_aux_hidden_state_layer_ids``, ``transformer_layer_config``, ``layers.0.*`` names). The
converter reads ``eagle_aux_hidden_state_layer_ids`` from the top level of config.json only;
llama.cpp then captures the *input* of target layer ``id`` (``llama_set_embeddings_layer_inp``),
i.e. HF ``hidden_states[id]``, draftsmith's ``target_layers`` convention, so the ids are written
unchanged. The SGLang layout is accepted by the converter too, but its ids sit under
``eagle_config`` (and are shifted by one): the converter ignores them and falls back to ``[2, n//2,
n-3]``, which is right only for exports trained on exactly those layers. The embedding is left out
(llama.cpp's EAGLE-3 decoder then takes the target's), and ``d2t`` is written when the draft
vocabulary is smaller than the target's (the converter turns it into absolute target ids).

This module runs llama.cpp's tools as subprocesses; where they live (``root``: the ``make llamacpp``
cache with ``convert_hf_to_gguf.py``, ``pydeps/`` and ``bin/``) is the caller's to say
(``bench/llamacpp_build.py`` finds it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from draftsmith.common.errors import InputError
from draftsmith.export.converters import ConvertRequest, ExportFormat, register_format
from draftsmith.export.format import ExportError, atomic_folder_write, read_config, read_export
from draftsmith.export.speculators import speculators_config, speculators_tensors
from draftsmith.export.verifier import verifier_architectures

log = logging.getLogger(__name__)

GGUF_METHODS = (
    "eagle3",
    "dflash",
)  # drafters llama.cpp's --spec-type runs from a converted draftsmith export
SPEC_TYPES = {
    "eagle3": "draft-eagle3",
    "dflash": "draft-dflash",  # llama.cpp's --spec-type of each
    "dspark": "draft-dspark",
}  # a DFlash export with DSpark heads (converter_input: spec_method)
DRAFT_FILE = "draft.gguf"
MANIFEST = "gguf.json"
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def converter_input(
    export_dir: str | Path, out_dir: Path, target_dir: str | Path
) -> dict[str, Any]:
    """Write the folder ``convert_hf_to_gguf.py`` converts (EAGLE-3: speculators layout, no
    embedding; DFlash: the z-lab layout) into ``out_dir``; returns the export's config."""
    method = read_config(export_dir)["method"]
    if method not in GGUF_METHODS:
        raise ExportError(
            f"llama.cpp runs EAGLE-3 and DFlash drafters only; {export_dir} is a {method!r} export"
        )
    if method == "dflash":
        from draftsmith.export.dflash import write_zlab
        from draftsmith.export.dspark import has_dspark_heads, write_deepspec

        out_dir.mkdir(parents=True, exist_ok=True)
        if has_dspark_heads(
            export_dir
        ):  # DSpark-shaped: llama.cpp's draft-dspark keeps the heads (export/dspark.py)
            return write_deepspec(export_dir, out_dir, target_dir)
        return write_zlab(export_dir, out_dir)
    config, state = read_export(export_dir)
    arch = config["architecture"]
    if len(arch["target_layers"]) != 3:
        raise ExportError(
            f"llama.cpp's EAGLE-3 reads exactly 3 target layers; {export_dir} taps "
            f"{arch['target_layers']}"
        )
    tensors = speculators_tensors(
        state, full_vocab=int(arch["draft_vocab_size"]) == int(arch["vocab_size"])
    )
    dtype = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    archs = verifier_architectures(str(target_dir), str(config["target"].get("model_type")))
    out_config = speculators_config(
        config,
        str(target_dir),
        int((config.get("inference") or {}).get("depth", 4)) + 1,
        archs,
        dtype,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out_dir / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
    return config


def _env(root: Path) -> dict[str, str]:
    """The environment the cached converter runs in: the build's ``pydeps/`` (sentencepiece, gguf)
    first."""
    path = os.pathsep.join(filter(None, [str(root / "pydeps"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def refusal_line(stderr: str) -> str:
    """The one line that says why llama.cpp's converter refused: its last error line, else its last
    line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [
        ln
        for ln in lines
        if "error" in ln.lower() or ln.startswith(("ValueError", "KeyError", "NotImpl"))
    ]
    line = (errors or lines or ["(no output)"])[-1]
    return line.removeprefix("ERROR:hf-to-gguf:").strip()


def run_converter(
    root: Path,
    model_dir: Path,
    outfile: Path,
    target_dir: Path | None = None,
    python: str = sys.executable,
    timeout_s: float = 1800.0,
) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outtype bf16 --outfile OUTFILE [--target-model-dir
    TARGET]``; a refusal raises :class:`ExportError` with the converter's own one-line reason."""
    argv = [
        python,
        str(root / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outtype",
        "bf16",
        "--outfile",
        str(outfile),
    ]
    if target_dir is not None:
        argv += ["--target-model-dir", str(target_dir)]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        errors="replace",
        env=_env(root),
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0 or not outfile.is_file():
        raise ExportError(
            f"llama.cpp's convert_hf_to_gguf.py refused {model_dir}: {refusal_line(proc.stderr)}"
        )
    return outfile


def quantize(root: Path, src: Path, out: Path, qtype: str, threads: int = 2) -> Path:
    """``llama-quantize SRC OUT QTYPE`` (the target; the drafter stays BF16)."""
    if qtype.upper() not in QUANT_TYPES:
        raise InputError(f"--quantize {qtype!r}; valid: {', '.join(QUANT_TYPES)}")
    proc = subprocess.run(
        [str(root / "bin" / "llama-quantize"), str(src), str(out), qtype.upper(), str(threads)],
        capture_output=True,
        text=True,
        errors="replace",
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0 or not out.is_file():
        raise ExportError(f"llama-quantize {qtype} failed: {refusal_line(proc.stderr)}")
    return out


def _place(src: Path, dst: Path) -> None:
    """A hard link to ``src`` when the file system allows it (GGUF files are read-only inputs), else
    a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def to_gguf(
    export_dir: str | Path,
    out_dir: str | Path,
    target_dir: str | Path,
    root: str | Path,
    target_gguf: str | Path | None = None,
    quant: str | None = None,
    python: str = sys.executable,
    source: str | Path | None = None,
) -> Path:
    """Write ``OUT/draft.gguf`` (the drafter, BF16), ``OUT/target-bf16.gguf`` (``target_gguf`` when
    given, a cached conversion of ``target_dir``, else converted here), ``OUT/target-<QUANT>.gguf``
    with ``quant`` and ``OUT/gguf.json`` (what each file is and the command that serves them),
    atomically."""
    root, target_dir, source = Path(root), Path(target_dir), Path(source or export_dir)

    def fill(tmp: Path) -> None:
        spec_dir = tmp / drafter_folder_name(
            read_config(export_dir)["method"]
        )  # general.name (module docstring)
        try:
            config = converter_input(export_dir, spec_dir, target_dir)
            run_converter(root, spec_dir, tmp / DRAFT_FILE, target_dir, python)
        finally:
            shutil.rmtree(spec_dir, ignore_errors=True)
        target = tmp / "target-bf16.gguf"
        if target_gguf is not None:
            _place(Path(target_gguf), target)
        else:
            run_converter(root, target_dir, target, python=python)
        files = {"draft": DRAFT_FILE, "target": target.name}
        if quant:
            files["target"] = quantize(
                root, target, tmp / f"target-{quant.upper()}.gguf", quant
            ).name
            files["target_bf16"] = target.name
        (tmp / MANIFEST).write_text(
            json.dumps(gguf_manifest(config, files, source, target_dir), indent=2) + "\n"
        )

    out = atomic_folder_write(out_dir, fill, sources=(export_dir, source))
    log.info("wrote llama.cpp GGUF folder %s", out)
    return out


def drafter_folder_name(method: str) -> str:
    """The name of the folder the converter reads the drafter from: llama.cpp takes ``general.name``
    from it."""
    return f"draftsmith-{method}-drafter"


def gguf_manifest(
    config: dict[str, Any], files: dict[str, str], source: Path, target_dir: Path
) -> dict[str, Any]:
    """``gguf.json``: the files, the target, and the commands that run them: ``run`` with the tool
    ``make llamacpp`` builds (``llama-speculative-simple``), ``serve`` for a llama.cpp build with
    ``llama-server`` (not built here).
    """
    spec_type = SPEC_TYPES[config.get("spec_method", config["method"])]
    flags = f"-m {files['target']} -md {DRAFT_FILE} --spec-type {spec_type}"
    manifest = {
        "method": config["method"],
        "converted_from": str(source.resolve()),
        "files": files,
        "target": {"folder": str(target_dir), **config["target"]},
        "target_layers": config["architecture"]["target_layers"],
        "spec_type": spec_type,
    }
    # llama.cpp's block is n_max + 1 tokens: the trained block at block_size - 1
    if config["method"] == "dflash":
        manifest["draft_n_max"] = int(config["architecture"]["block_size"]) - 1
        flags += f" --spec-draft-n-max {manifest['draft_n_max']}"
    manifest["run"] = (
        f"llama-speculative-simple {flags} -p PROMPT  (bin/ of the `make llamacpp` build)"
    )
    manifest["serve"] = (
        f"llama-server {flags}  (needs a llama.cpp build with llama-server: `make llamacpp` "
        "builds none)"
    )
    return manifest


def _convert_request(request: ConvertRequest) -> Path:
    """``--format gguf``: the cached llama.cpp build converts the drafter (and the target, cached
    once as BF16)."""
    verifier = request.verifier_folder()
    root, target_gguf = request.host.llamacpp(verifier)
    return to_gguf(
        request.export_dir,
        request.out,
        verifier,
        root,
        target_gguf,
        quant=request.options.get("quantize"),
        source=request.source,
    )


def _gguf_arguments(parser: Any) -> None:
    parser.add_argument(
        "--quantize",
        default=None,
        metavar="QTYPE",
        help=(
            "--format gguf: also write the target "
            "quantised with llama-quantize (Q4_1, Q8_0, ...); the drafter stays BF16"
        ),
    )


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """``gguf.json`` of a :func:`to_gguf` folder, with its files as absolute paths."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ExportError(
            f"{folder} has no {MANIFEST}: convert the export first with "
            f"`draftsmith export EXPORT --format gguf --out {folder}`"
        )
    manifest = json.loads(path.read_text())
    manifest["paths"] = {k: str((Path(folder) / v).resolve()) for k, v in manifest["files"].items()}
    return manifest


register_format(
    ExportFormat(
        "gguf",
        GGUF_METHODS,
        _convert_request,
        help="llama.cpp GGUF files (draft + target)",
        add_arguments=_gguf_arguments,
        refusal_hint=" (llama.cpp's --spec-type runs DFlash and EAGLE-3 drafters only)",
    )
)
