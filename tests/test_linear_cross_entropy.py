"""Fused chunked linear + cross-entropy: values and gradients equal the plain ``F.cross_entropy(h @
W.T, y)``.

Tolerances: fp32 inputs match the plain fp32 path to 1e-5 relative / 1e-6 absolute (only the
summation order differs). bf16 inputs are compared with the plain bf16 path (same bf16 matmuls, fp32
softmax): loss within 1e-2 relative, gradients within 2% of their largest magnitude (the chunked
gradient is rounded to bf16 once per chunk before its matmul, the plain one once as a whole, so
individual elements can differ by a bf16 ulp or two).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from omegaconf import OmegaConf

from draftsmith.common.errors import ConfigError
from draftsmith.distill.losses.core import LMHeadLoss
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.kernels.linear_cross_entropy import linear_cross_entropy
from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree

pytestmark = pytest.mark.unit

N, H, V = 37, 16, 50


def _inputs(dtype=torch.float32, seed=0, n=N, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, (n,), generator=g)
    return h, w, b, y


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_hard_labels_match_plain_path(chunk, bias):
    h, w, b, y = _inputs(bias=bias)
    ref = F.cross_entropy(F.linear(h, w, b), y)
    out = linear_cross_entropy(h, w, y, bias=b, chunk_size=chunk)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(out.loss * 0.7, h, w, b), _grads(ref * 0.7, h, w, b), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_matches_plain_bf16_path_within_stated_tolerance():
    h, w, _, y = _inputs(torch.bfloat16)
    ref = F.cross_entropy((h @ w.T).float(), y)
    out = linear_cross_entropy(h, w, y, chunk_size=8)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref, rtol=1e-2, atol=0)
    for got, want in zip(_grads(out.loss, h, w), _grads(ref, h, w), strict=True):
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def test_soft_targets_with_temperature_match_soft_cross_entropy():
    h, w, _, _ = _inputs()
    teacher = torch.randn(
        N, V, generator=torch.Generator().manual_seed(1)
    ).bfloat16()  # targets run in bf16
    temp = 2.0
    p = F.softmax(teacher.float() / temp, dim=-1)
    ref = -(p * F.log_softmax(F.linear(h, w) / temp, dim=-1)).sum(-1).mean()
    out = linear_cross_entropy(h, w, target_logits=teacher, temperature=temp, chunk_size=6)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(out.loss, h, w), _grads(ref, h, w), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_row_weights_and_ignore_index_give_the_weighted_mean_of_scored_rows():
    h, w, _, y = _inputs()
    y = y.clone()
    y[::4] = -100
    rw = torch.rand(N, generator=torch.Generator().manual_seed(2))
    per_row = F.cross_entropy(F.linear(h, w), y, reduction="none")  # 0 on ignored rows
    scored = rw * (y != -100)
    ref = (per_row * scored).sum() / scored.sum()
    out = linear_cross_entropy(h, w, y, row_weight=rw, chunk_size=7)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(out.loss, h, w), _grads(ref, h, w), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    unweighted = linear_cross_entropy(h, w, y).loss
    torch.testing.assert_close(
        unweighted, F.cross_entropy(F.linear(h, w), y, ignore_index=-100), rtol=1e-5, atol=1e-6
    )
    summed = linear_cross_entropy(h, w, y, reduction="sum").loss
    torch.testing.assert_close(summed, per_row.sum(), rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_gradient_and_none_is_computed():
    h, w, _, y = _inputs()
    frozen = w.detach()
    out = linear_cross_entropy(h, frozen, y, chunk_size=8)
    # the [V, H] weight gradient was never accumulated
    assert out.loss.grad_fn.saved_tensors[1] is None
    out.loss.backward()
    assert frozen.grad is None
    torch.testing.assert_close(
        h.grad, _grads(F.cross_entropy(h @ frozen.T, y), h)[0], rtol=1e-5, atol=1e-6
    )
    with torch.no_grad():  # evaluation: no gradient work at all
        assert not linear_cross_entropy(h, w, y).loss.requires_grad


def test_empty_input_gives_zero_loss_and_zero_gradients():
    h, w, _, y = _inputs(n=0)
    out = linear_cross_entropy(h, w, y, topk=3)
    assert out.loss.item() == 0.0 and out.topk.shape == (0, 3)
    out.loss.backward()
    assert h.grad.shape == (0, H) and torch.count_nonzero(w.grad) == 0
    h2, w2, _, y2 = _inputs()
    all_ignored = linear_cross_entropy(h2, w2, torch.full_like(y2, -100)).loss
    assert all_ignored.item() == 0.0


def test_topk_ids_are_the_logits_topk():
    h, w, _, y = _inputs()
    out = linear_cross_entropy(h, w, y, topk=4, chunk_size=10)
    assert torch.equal(out.topk, F.linear(h, w).topk(4, dim=-1).indices)


def test_autocast_runs_bf16_matmuls_and_returns_fp32_gradients():
    h, w, _, y = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), y)
        out = linear_cross_entropy(h, w, y, chunk_size=9)
    torch.testing.assert_close(out.loss, ref, rtol=1e-2, atol=0)
    for got, want in zip(_grads(out.loss, h, w), _grads(ref, h, w), strict=True):
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_bad_inputs_raise_clear_errors():
    h, w, _, y = _inputs()
    cases = [
        (lambda: linear_cross_entropy(h, w[:, :8], y), r"weight \(50, 8\) does not match hidden"),
        (
            lambda: linear_cross_entropy(h, w, y[:5]),
            r"labels must be a long tensor of shape \[37\]",
        ),
        (lambda: linear_cross_entropy(h, w, y.float()), "labels must be a long tensor"),
        (
            lambda: linear_cross_entropy(h, w, target_logits=torch.zeros(N, V + 1)),
            r"target_logits must be \[37, 50\]",
        ),
        (lambda: linear_cross_entropy(h, w), "exactly one of labels"),
        (
            lambda: linear_cross_entropy(h, w, y, target_logits=torch.zeros(N, V)),
            "exactly one of labels",
        ),
        (lambda: linear_cross_entropy(h[None], w, y), r"hidden must be \[N, H\]"),
        (lambda: linear_cross_entropy(h, w, y, bias=torch.zeros(3)), r"bias must be \[50\]"),
        (
            lambda: linear_cross_entropy(h, w, y, row_weight=torch.ones(3)),
            r"row_weight must be \[37\]",
        ),
        (lambda: linear_cross_entropy(h, w, y, chunk_size=0), "chunk_size must be >= 1"),
        (lambda: linear_cross_entropy(h, w, y, reduction="none"), "reduction='none'"),
        (lambda: linear_cross_entropy(h, w, y, temperature=0), "temperature must be > 0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_config_switch_parses_and_rejects_bad_values():
    cfg = OmegaConf.create(
        {"loss": {"fused_linear_ce": "auto", "chunk_size": None, "lm_head_dtype": "bf16"}}
    )
    assert LMHeadLoss.from_config(cfg) == LMHeadLoss(True, None, torch.bfloat16)
    assert not LMHeadLoss.from_config(OmegaConf.create({"loss": {"fused_linear_ce": False}})).fused
    assert LMHeadLoss.from_config(OmegaConf.create({})).fused  # no loss block: the default (on)
    for bad, message in [
        ({"fused_linear_ce": "maybe"}, "loss.fused_linear_ce='maybe'"),
        ({"chunk_size": 0}, "loss.chunk_size must be >= 1"),
        ({"lm_head_dtype": "fp8"}, "loss.lm_head_dtype='fp8'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LMHeadLoss.from_config(OmegaConf.create({"loss": bad}))


@pytest.mark.parametrize("labels", ["dataset", "target_soft"])
def test_medusa_objective_fused_equals_plain_in_loss_metrics_and_gradients(tiny_tokenizer, labels):
    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    arch = MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=2)
    torch.manual_seed(0)
    ids = torch.randint(5, target.vocab_size, (2, 12))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": (torch.rand(2, 12) > 0.3).long(),
    }
    results = []
    for fused in (True, False):
        heads = MedusaHeads(arch, target.lm_head_weight.float())
        for p in heads.parameters():
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
        objective = MedusaObjective(
            heads,
            0.8,
            labels,
            5,
            default_tree(2, 8, 4),
            {"top_k": 4},
            LMHeadLoss(fused=fused, chunk_size=3),
        )
        feats = target.features(
            ids, batch["attention_mask"], FeatureTaps(final_hidden=True, logits=True)
        )
        loss, metrics = objective.loss(batch, feats)
        loss.backward()
        results.append((loss, metrics, [p.grad for p in heads.parameters()]))
    (loss_f, met_f, grad_f), (loss_p, met_p, grad_p) = results
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-6)
    assert met_f.keys() == met_p.keys()
    for key in met_f:
        torch.testing.assert_close(met_f[key], met_p[key], rtol=1e-5, atol=1e-6)
    for got, want in zip(grad_f, grad_p, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
