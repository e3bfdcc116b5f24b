"""The lean decoder's execution weights (runtime/target/model.py): per-layer weight tuples in the
chosen linear backend's form, the packed LM head, the one-call native forward (``TargetStack``) on
the cpp backend, and the RoPE tables; rebuilt whenever ``.to()`` / ``.half()`` replace the buffers.
"""

from __future__ import annotations

from functools import partial

from draftsmith.runtime.target.linear_ops import choose_linear_ops
from draftsmith.runtime.target.model_config import rope_inv_freq, rope_tables
from draftsmith.runtime.target.torch_layers import last_dim_rms_norm, llama_layer


class ExecutionWeights:
    """Mixin of :class:`~draftsmith.runtime.target.model.LeanDecoder`: builds what its forward runs
    from its buffers (``layers``, ``lm_head``, ``norm_w``) and keeps it in step with them."""

    def _apply(self, fn, recurse=True):  # nn.Module hook behind .to() / .half() / .cuda()
        # .to()/.half() replace buffers: re-tie the head, rebuild RoPE tables and execution weights.
        tied = self.lm_head is self.embed
        out = super()._apply(fn, recurse)
        if tied:
            self.lm_head = self.embed
        n, self._rope_len = self._rope_len, 0
        self._ensure_rope(n)
        self._build_exec()
        return out

    def _build_exec(self) -> None:
        """Per-layer weight tuples in the chosen backend's form (a tuple beats attribute lookups),
        the head, and on the cpp backend the one-call forward (``TargetStack``) holding them."""
        c = self.config
        ops, self.linear_plan = choose_linear_ops(
            self.linear_backend,
            self.dtype,
            self.device,
            (c.head_dim, c.hidden_size, c.intermediate_size),
            compiled=self._compile,
        )
        self._ops = ops
        self._torch_layer = partial(
            llama_layer, ops.linear, ops.linear_add, self.kernel_backend
        )  # C++ layer's twin
        self._exec = [
            (
                w.ln1,
                ops.pack(w.wqkv),
                w.bqkv,
                w.qn,
                w.kn,
                ops.pack_res(w.wo),
                w.bo,
                w.ln2,
                ops.pack(w.wgu),
                w.bgu,
                ops.pack_res(w.wdown),
                w.bdown,
            )
            for w in self.layers
        ]
        self._head = ops.pack_head(self.lm_head)
        self._final_norm = getattr(ops, "norm", None) or last_dim_rms_norm
        stack = getattr(ops, "stack", None)  # cpp: the whole forward as one native call
        self._stack = stack and stack(
            self._exec,
            self.norm_w,
            self._head,
            c.num_heads,
            c.num_kv_heads,
            c.rms_norm_eps,
            c.head_dim**-0.5,
        )

    def _ensure_rope(self, n: int) -> None:
        """Precompute cos / signed-sin tables [n, 1, d] for positions 0..n-1 (fp32 math, stored in
        model dtype)."""
        if n <= self._rope_len:
            return
        n = max(n, 2 * self._rope_len)
        self._cos, self._sin = rope_tables(
            rope_inv_freq(self.config), n, self.dtype, self.device
        )  # [n, 1, d]
        self._rope_len = n
