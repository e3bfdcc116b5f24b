"""``trainer.compile``: the target forward and the objective's loss through ``torch.compile``.

Both are written to trace without a graph break (static shapes with packed rows, no read-back, no
data-dependent op; tests/test_compile.py asserts zero breaks with ``torch._dynamo.explain``), so
each compiles into one graph: the ~1,800 eager ops of a 30-layer HF forward and the TTT unroll with
its loss become a few fused kernels. The first training step runs eagerly (transformers installs its
output-capturing hooks there, under a lock dynamo cannot trace); later steps use the compiled
functions. Validation stays eager (it asks for other taps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class CompiledStep:
    """The compiled ``features`` and ``loss`` of a target and an objective, made after
    ``eager_steps`` eager steps; ``backend`` is torch.compile's (``inductor``; tests use
    ``aot_eager``, which needs no C++ compiler).
    """

    enabled: bool = False
    backend: str = "inductor"
    eager_steps: int = 1
    features: Callable[..., Any] | None = None
    loss: Callable[..., Any] | None = None
    _seen: int = 0

    def parts(self, target: Any, objective: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """(features, loss) for this training step: the eager ones until compiled, then the compiled
        ones."""
        if not self.enabled or self._seen < self.eager_steps:
            self._seen += 1
            return (
                getattr(target, "features", None),
                objective.loss,
            )  # objectives with own features use none
        if self.features is None:
            self.features = torch.compile(target.features, backend=self.backend)
            self.loss = torch.compile(objective.loss, backend=self.backend)
        return self.features, self.loss
