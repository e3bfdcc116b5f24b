"""Memory per GPU and throughput of online EAGLE-3 training under each trainer preset, on paper.

Pure arithmetic (no torch): ``docs/CLUSTER.md`` prints its tables with ``python -m
draftsmith.distill.cluster.memory_model`` and ``tests/test_cluster_memory.py`` checks the drafter's
parameter count exactly and the activation model against the bytes autograd actually saves in a CPU
training step of tiny EAGLE-3 drafters.

Terms (bytes per GPU, W GPUs):

* frozen target: bf16 weights, ``2 P_t`` replicated, or ``2 (P_t - P_embed) / W + 2 P_embed + 2 x 2
  P_layer`` sharded (embeddings / LM head stay whole; two all-gathered layers in flight), plus the
  target forward's transient: every hidden state ``(L + 1) H`` (HF ``output_hidden_states``) and the
  logits ``V`` per token, bf16.
* drafter states: DDP ``16 P_d`` (fp32 weights, grads, Adam m and v); FSDP full shard and ZeRO-3
  ``16 P_d / W``; ZeRO-2 ``2 P_d + 14 P_d / W`` (bf16 weights replicated); optimizer offload removes
  the ``12 P_d / W`` of fp32 master and Adam states. Plus the drafter's frozen copy of the target
  embedding (``4 V H``, a buffer).
* drafter activations per token: ``e [3 H + k (17 H + 2 H_kv + 4 I + 0.5 V_d)]`` for ``k`` TTT
  steps, ``e`` bytes per element (4 fp32, 2 bf16-mixed); activation checkpointing keeps the layer
  inputs only (``e k 3 H``) and recomputes the rest.
* feature cache (offline training): three tapped hidden states and the last one in bf16 (``8 H``
  bytes) plus the token id and loss mask (5 bytes) per token; the target's distribution is
  recomputed from the last hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder: parameters and the dimensions the model needs."""

    name: str
    params: float
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    tied_embeddings: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def embed_params(self) -> int:
        """Embedding plus LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def layer_params(self) -> float:
        return (self.params - self.embed_params) / self.layers


TARGETS = {
    "smollm2-135m": Shape(
        "SmolLM2-135M", 134.5e6, 576, 30, 49152, 1536, 9, 3, tied_embeddings=True
    ),
    "llama-3.1-8b": Shape("Llama-3.1-8B", 8.03e9, 4096, 32, 128256, 14336, 32, 8),
    "qwen2.5-32b": Shape("Qwen2.5-32B", 32.8e9, 5120, 64, 152064, 27648, 40, 8),
    "llama-3.1-70b": Shape("Llama-3.1-70B", 70.6e9, 8192, 80, 128256, 28672, 64, 8),
    "llama-3.1-405b": Shape("Llama-3.1-405B", 405.9e9, 16384, 126, 128256, 53248, 128, 8),
}
PRESETS = ("ddp", "fsdp", "fsdp+shard", "zero2", "zero3", "zero3+shard")


def eagle3_params(t: Shape, draft_vocab: int) -> int:
    """Trainable parameters of our EAGLE-3 drafter: fc (3H -> H), one decoder layer whose q/k/v read
    2H, final norm, LM head over the draft vocabulary (``drafters/eagle3.py``)."""
    h, kv = t.hidden, t.kv_dim
    attention = 2 * h * h + 2 * (2 * h * kv) + h * h  # q: 2H -> H, k and v: 2H -> kv, o: H -> H
    # fc, attn, mlp, 4 norms, head
    return 3 * h * h + attention + 3 * h * t.intermediate + 4 * h + draft_vocab * h


def activation_bytes_per_token(
    t: Shape, draft_vocab: int, ttt_steps: int, elem_bytes: float = 2, checkpointing: bool = False
) -> float:
    """Bytes autograd keeps for the backward per training token (see the module docstring)."""
    if checkpointing:
        return elem_bytes * ttt_steps * 3 * t.hidden
    per_step = 17 * t.hidden + 2 * t.kv_dim + 4 * t.intermediate + 0.5 * draft_vocab
    return elem_bytes * (3 * t.hidden + ttt_steps * per_step)


def feature_cache_bytes_per_token(t: Shape) -> int:
    """Offline cache (``draftsmith cache-features``): 3 taps + last hidden state in bf16, token id
    (int32), attention and loss masks (uint8 each)."""
    return 4 * t.hidden * 2 + 6


def memory_per_gpu(
    t: Shape,
    preset: str,
    world: int = 8,
    draft_vocab: int = 32000,
    ttt_steps: int = 7,
    tokens_per_gpu: int = 4096,
    checkpointing: bool = False,
    offload_optimizer: bool = False,
) -> dict[str, float]:
    """Bytes per GPU by term for ``preset`` (one of :data:`PRESETS`) with ``tokens_per_gpu`` tokens
    per micro-batch."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}; valid: {', '.join(PRESETS)}")
    p_d = eagle3_params(t, draft_vocab)
    if preset.endswith("+shard"):
        target = (
            2 * (t.params - t.embed_params) / world + 2 * t.embed_params + 2 * 2 * t.layer_params
        )
    else:
        target = 2 * t.params
    target_forward = tokens_per_gpu * 2 * ((t.layers + 1) * t.hidden + t.vocab)
    optimizer = 0 if offload_optimizer else 12 * p_d
    if preset == "ddp":
        # fp32 weights (autocast computes in bf16), grads, Adam m and v; all replicated
        drafter = 16 * p_d
    elif preset == "zero2":
        drafter = 2 * p_d + (2 * p_d + optimizer) / world
    # fsdp / zero3: grads (4 fp32 / 2 bf16 + 2) and master + Adam (12) sharded, plus one gathered
    # bf16 layer
    else:
        drafter = (4 * p_d + optimizer) / world + 2 * eagle3_params(t, 0)
    buffers = 4 * t.vocab * t.hidden
    activations = tokens_per_gpu * activation_bytes_per_token(
        t, draft_vocab, ttt_steps, 2, checkpointing
    )
    terms = {
        "target": target,
        "target_forward": target_forward,
        "drafter_states": drafter,
        "drafter_buffers": buffers,
        "activations": activations,
    }
    terms["total"] = sum(terms.values())
    return terms


def tokens_per_second(
    t: Shape,
    draft_vocab: int = 32000,
    ttt_steps: int = 7,
    flops: float = 989e12,
    mfu: float = 0.4,
    seq: int = 2048,
) -> float:
    """Training tokens/s per GPU when compute-bound: the target's forward (2 P_t + causal attention)
    and the drafter's forward + backward (6 FLOPs per parameter per TTT step) at ``mfu`` of
    ``flops`` (H100 bf16 dense).
    """
    # matmuls + QK^T / PV over half the context on average
    target = 2 * t.params + 2 * t.layers * seq * t.hidden
    drafter = 6 * ttt_steps * eagle3_params(t, draft_vocab)
    return flops * mfu / (target + drafter)


def largest_fitting(
    preset: str, world: int = 8, gpu_bytes: float = 80 * GB, headroom: float = 0.9, **kwargs: float
) -> str:
    """The largest of :data:`TARGETS` whose total fits ``headroom`` of a GPU under ``preset``."""
    fits = [
        s
        for s in TARGETS.values()
        if memory_per_gpu(s, preset, world, **kwargs)["total"] <= headroom * gpu_bytes
    ]
    return max(fits, key=lambda s: s.params).name if fits else "none"


def report(world: int = 8) -> str:
    """Markdown tables of memory per GPU (GB) by term and preset, fits and throughput."""
    lines = [
        (
            "| target | preset | target | target fwd | drafter states | buffers | activations |"
            " total |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in ("smollm2-135m", "llama-3.1-8b", "llama-3.1-70b"):
        for preset in PRESETS:
            m = memory_per_gpu(TARGETS[key], preset, world)
            cells = " | ".join(
                f"{m[k] / GB:.1f}"
                for k in (
                    "target",
                    "target_forward",
                    "drafter_states",
                    "drafter_buffers",
                    "activations",
                    "total",
                )
            )
            lines.append(f"| {TARGETS[key].name} | {preset} | {cells} |")
    lines += [
        "",
        "| preset | largest target on 8 x 80 GB | with activation checkpointing |",
        "|---|---|---|",
    ]
    for preset in PRESETS:
        lines.append(
            f"| {preset} | {largest_fitting(preset, world)} | "
            f"{largest_fitting(preset, world, checkpointing=True)} |"
        )
    lines += [
        "",
        "| target | drafter params | activations / token | cache / token | tokens/s per GPU |",
        "|---|---|---|---|---|",
    ]
    for shape in TARGETS.values():
        lines.append(
            f"| {shape.name} | {eagle3_params(shape, min(32000, shape.vocab)) / 1e6:.0f}M |"
            f" {activation_bytes_per_token(shape, 32000, 7) / 1e3:.0f} kB |"
            f" {feature_cache_bytes_per_token(shape) / 1e3:.1f} kB |"
            f" {tokens_per_second(shape):,.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
