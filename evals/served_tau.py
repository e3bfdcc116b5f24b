"""Served tau during validation: the runtime's own greedy speculative loop on a few held-out
prompts.

Training accuracy says how often the drafter agrees with the target on the training side's features;
what a user gets is the tau of the export served by the runtime. The two part when serving feeds the
drafter something other than what training did (a tap one layer off, features one position off):
accuracy stays high and tau collapses. :class:`ServedTauProbe` measures the second number during
training. ``distill/`` may not import serving code, so the trainer is handed this probe as a
callable (``DistillModule(served_probe=...)``, wired by ``train.py``); the module writes a temporary
export of its current weights and calls ``probe(export_dir)``.

The probe loads the export exactly as ``draftsmith bench`` does
(:func:`~draftsmith.runtime.serving.load_runtime`: the export's inference block picks verifier, stop
policy and proposer options; greedy) and pools tau over the prompts the way the bench does, so on
the same prompts, dtype and token budget the two numbers are equal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.bench.prompts import load_prompts
from draftsmith.common.errors import ConfigError
from draftsmith.export.format import read_config
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.prompt_limits import context_limit
from draftsmith.runtime.drafting.registry import registered_methods
from draftsmith.runtime.serving import load_runtime

# Validation serves MT-Bench past its 40th question: the benches and the learning curve take the
# first prompts, so a checkpoint chosen on these (validation.served_tau.keep_best) is not chosen on
# the prompts it is reported on.
HELD_OUT = "mtbench[40:]"


@dataclass
class ServedTauProbe:
    """``probe(export_dir) -> {"served_tau", ...}``: greedy speculative decoding of ``prompts``
    prompts of ``prompt_set`` (``mtbench``, ``humaneval``, a jsonl with a ``prompt`` field or a
    ``[a:b]`` slice of one, as ``bench --prompts``; default :data:`HELD_OUT`), at most
    ``max_new_tokens`` each, in ``dtype`` (``auto`` as the bench). ``every``: the trainer probes
    every N-th validation pass (and always the last one)."""

    every: int = 1
    prompts: int = 4
    max_new_tokens: int = 32
    prompt_set: str = HELD_OUT
    dtype: str = "auto"
    # the target folder; None: the one the export records (the run's target)
    target: str | None = None

    def __post_init__(self) -> None:
        if int(self.every) < 1:
            raise ConfigError(
                f"validation.served_tau.every must be >= 1 for a probe (0: off), got {self.every}"
            )
        if int(self.prompts) < 1:
            raise ConfigError(f"validation.served_tau.prompts must be >= 1, got {self.prompts}")
        if int(self.max_new_tokens) < 1:
            raise ConfigError(
                f"validation.served_tau.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )

    def serves(self, method: str) -> bool:
        """Whether the runtime has a proposer for exports of ``method`` (controllers and target
        makers: no)."""
        return method in registered_methods()

    def __call__(self, export_dir: str | Path) -> dict[str, Any] | None:
        """Served tau of ``export_dir``; None when its method has no runtime proposer (nothing to
        serve)."""
        if not self.serves(read_config(export_dir)["method"]):
            return None
        start = time.perf_counter()
        runtime = load_runtime(
            str(export_dir), self.target, dtype=self.dtype, verifier="auto", temperature=0.0
        )
        prompts = load_prompts(
            self.prompt_set,
            runtime.tokenizer,
            int(self.prompts),
            max_len=context_limit(runtime.model),
        )
        results = [
            runtime.speculative.generate(p, int(self.max_new_tokens), eos_ids=runtime.eos_ids)
            for p in prompts
        ]
        return served_summary(results, self, time.perf_counter() - start)


def served_summary(results: list[Any], probe: ServedTauProbe, seconds: float) -> dict[str, Any]:
    """The probe's record from the speculative results of every prompt, tau pooled over all their
    verify steps (the bench's definition: :func:`draftsmith.runtime.decoding.metrics.tau` of every
    step of every prompt).
    """
    accepted = [
        a for r in results for a in r.accepted_per_step
    ]  # every verify step of every prompt
    depths = [d for r in results for d in r.depths]
    by_position = metrics.acceptance_by_position(accepted, depths)
    return {
        "served_tau": metrics.tau(accepted),
        "acceptance_by_position": by_position,
        "prompts": len(results),
        "prompt_set": probe.prompt_set,
        "max_new_tokens": int(probe.max_new_tokens),
        "dtype": probe.dtype,
        "verify_steps": len(accepted),
        "seconds": round(seconds, 2),
    }


def probe_from_config(cfg: Any) -> ServedTauProbe | None:
    """The probe ``validation.served_tau`` asks for (a mapping with ``every``, ``prompts``,
    ``max_new_tokens``, ``prompt_set``, ``dtype``); None when it is absent or ``every`` is 0.
    ValueError for bad values.
    """
    block = (cfg.get("validation") or {}).get("served_tau") if hasattr(cfg, "get") else None
    if not block:
        return None
    every = int(block.get("every", 1) or 0)
    if every < 0:
        raise ConfigError(f"validation.served_tau.every must be >= 0 (0 = off), got {every}")
    if every == 0:
        return None
    prompt_set = str(block.get("prompt_set", HELD_OUT))
    from draftsmith.common.prompt_sets import prompt_texts

    # read now, before training: a set the probe cannot load would otherwise surface at the first
    # validation
    try:
        found = prompt_texts(prompt_set)
    except (OSError, ValueError) as err:
        raise ConfigError(f"validation.served_tau.prompt_set={prompt_set}: {err}") from None
    if not found:
        raise ConfigError(
            f"validation.served_tau.prompt_set={prompt_set} holds no prompts; pass mtbench[40:]"
            " (the default), humaneval or a .jsonl with a 'prompt' field"
        )
    return ServedTauProbe(
        every=every,
        prompts=int(block.get("prompts", 4)),
        max_new_tokens=int(block.get("max_new_tokens", 32)),
        prompt_set=prompt_set,
        dtype=str(block.get("dtype", "auto")),
    )
