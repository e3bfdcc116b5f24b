"""Acceptance-targeted losses (loss.acceptance): the formulas, the chunked + checkpointed head
against the unchunked reference (values and gradients), hard labels, config errors, and EAGLE-3
training with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from eagle3_objectives import fixed_batch_steps, make_objective
from omegaconf import OmegaConf

from draftsmith.common.errors import ConfigError
from draftsmith.distill.losses.acceptance import IGNORE_INDEX, acceptance_loss, row_losses
from draftsmith.distill.losses.core import LMHeadLoss
from draftsmith.distill.target.frozen import Target

pytestmark = pytest.mark.unit

KINDS = ("hybrid", "nla", "tv")


def _inputs(n: int = 13, hidden: int = 8, vocab: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = 2.0 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    return h, w, teacher


def test_the_overlap_is_the_acceptance_rate_and_each_kind_its_formula():
    g = torch.Generator().manual_seed(1)
    logits, teacher = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    p, q = teacher.softmax(-1), logits.softmax(-1)
    alpha = torch.minimum(p, q).sum(-1)
    assert torch.allclose(alpha, 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-6)  # 1 - TV
    kl = (p * (p.log() - q.log())).sum(-1)
    lam = torch.exp(-3.0 * alpha)
    expected = {"tv": 1 - alpha, "nla": -alpha.log(), "hybrid": lam * kl + (1 - lam) * (1 - alpha)}
    for kind, want in expected.items():
        got, overlap = row_losses(logits, None, teacher, kind, 3.0)
        assert torch.allclose(got, want, atol=1e-5), kind
        assert torch.allclose(overlap, alpha, atol=1e-6)
    with pytest.raises(ValueError, match="valid: hybrid, nla, tv"):
        row_losses(logits, None, teacher, "kl", 3.0)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_checkpointed_loss_matches_the_reference_in_values_and_gradients(kind):
    h, w, teacher = _inputs()
    ref_loss, ref_alpha = row_losses(F.linear(h, w), None, teacher, kind, 2.0)
    ref = ref_loss.mean()
    gh, gw = torch.autograd.grad(ref, (h, w))
    out = acceptance_loss(h, w, teacher_logits=teacher, kind=kind, eta=2.0, chunk_size=4, topk=3)
    assert torch.allclose(out.loss.double(), ref, atol=1e-6)
    assert torch.allclose(out.overlap.double(), ref_alpha.mean(), atol=1e-6)
    ch, cw = torch.autograd.grad(out.loss, (h, w))
    assert torch.allclose(ch, gh, atol=1e-6) and torch.allclose(cw, gw, atol=1e-6)
    assert torch.equal(out.topk, F.linear(h, w).topk(3, dim=-1).indices)


def test_hard_labels_skip_ignored_rows_and_nla_is_cross_entropy():
    h, w, _ = _inputs()
    labels = torch.randint(0, w.shape[0], (h.shape[0],), generator=torch.Generator().manual_seed(2))
    labels[::4] = IGNORE_INDEX
    out = acceptance_loss(h, w, labels, kind="nla", chunk_size=5)
    keep = labels != IGNORE_INDEX
    assert torch.allclose(
        out.loss.double(), F.cross_entropy(F.linear(h, w)[keep], labels[keep]), atol=1e-6
    )
    q_label = F.linear(h, w).softmax(-1)[keep].gather(-1, labels[keep][:, None])[:, 0]
    assert torch.allclose(out.overlap.double(), q_label.mean(), atol=1e-6)
    with pytest.raises(ValueError, match="either hard labels or teacher logits"):
        acceptance_loss(h, w)
    empty = acceptance_loss(h[:0], w, teacher_logits=torch.zeros(0, w.shape[0], dtype=w.dtype))
    # still a graph: DDP sees every parameter
    assert empty.loss.item() == 0.0 and empty.loss.requires_grad


def test_lm_head_loss_switches_objective_and_refuses_bad_settings():
    cfg = OmegaConf.create({"loss": {"acceptance": "hybrid", "acceptance_eta": 2.5}})
    head = LMHeadLoss.from_config(cfg)
    assert (head.acceptance, head.acceptance_eta) == ("hybrid", 2.5)
    h, w, teacher = _inputs()
    assert head(h, w, teacher_logits=teacher).overlap is not None
    assert (
        LMHeadLoss.from_config(OmegaConf.create({"loss": {}}))(h, w, teacher_logits=teacher).overlap
        is None
    )
    with pytest.raises(ConfigError, match="loss.acceptance='kl'; valid: none, hybrid, nla, tv"):
        LMHeadLoss.from_config(OmegaConf.create({"loss": {"acceptance": "kl"}}))
    with pytest.raises(ConfigError, match="loss.acceptance_eta must be > 0"):
        LMHeadLoss.from_config(
            OmegaConf.create({"loss": {"acceptance": "hybrid", "acceptance_eta": 0}})
        )


@pytest.mark.parametrize("kind", ("hybrid", "nla"))
def test_eagle3_trains_with_an_acceptance_loss_and_its_overlap_rises(tiny_tokenizer, kind):
    target = Target(
        build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2), tiny_tokenizer, "tiny"
    )
    objective = make_objective(target)
    objective.lm_loss = LMHeadLoss(acceptance=kind)
    losses, metrics = fixed_batch_steps(objective, target)
    overlaps = [float(m["step0/overlap"]) for m in metrics]
    assert losses[-1] < 0.8 * losses[0], losses
    assert overlaps[-1] > overlaps[0] + 0.05, overlaps
