"""recipe=diffusion_adapt on a tiny in-process Llama: the loss falls on a fixed batch, masks/pads
are right, and the adapted model round-trips through an ordinary HF folder that the runtime loads as
a diffusion target.
"""

from __future__ import annotations

import pytest
import torch
from recipe_configs import recipe_config

from draftsmith.distill.target.frozen import Target
from draftsmith.recipes.diffusion_adapt.objective import build, pad_with_eot, two_stream_mask
from draftsmith.runtime.target.diffusion_lm import load_diffusion_lm

pytestmark = pytest.mark.unit

DIFFUSION = {"diffusion": {"block_length": 4, "eps": 1e-3, "eot_pad": 4, "random_offset": True}}


def test_two_stream_mask_layout():
    blocks = torch.tensor([[0, 0, 1, 1]])
    mask = two_stream_mask(blocks, torch.ones(1, 4, dtype=torch.bool))[0, 0]  # [8, 8]
    assert mask[2, 3] and mask[3, 2] and not mask[1, 2]  # noisy: own block only
    # noisy reads earlier clean blocks
    assert mask[2, 4] and mask[2, 5] and not mask[2, 6] and not mask[0, 4]
    # clean: block causal, never noisy
    assert mask[6, 4] and mask[6, 7] and not mask[4, 6] and not mask[6, 2]


def test_pad_with_eot_counts_padding_in_loss():
    ids = torch.tensor([[5, 6, 7], [5, 6, 1]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss = torch.tensor([[0, 1, 1], [0, 1, 0]])
    out, lm = pad_with_eot(ids, valid, loss, eot=3, extra=2)
    assert out.tolist() == [[5, 6, 7, 3, 3], [5, 6, 3, 3, 3]]
    assert lm.int().tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 1, 1]]


def test_loss_decreases_and_folder_round_trips(tiny_target_dir, tmp_path):
    torch.manual_seed(0)
    target = Target.load(str(tiny_target_dir), "fp32")
    objective = build(recipe_config("diffusion_adapt", DIFFUSION), target)
    ids = torch.randint(5, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    batch["loss_mask"][:, :4] = 0
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
    losses = []
    for step in range(25):
        torch.manual_seed(step % 3)  # three fixed noise draws
        loss, metrics = objective.loss(batch, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
    state = objective.module.state_dict()
    # tied head left out (safetensors refuses shared tensors)
    assert "model.lm_head.weight" not in state
    objective.module.load_state_dict(state)  # and put back on load
    assert target.vocab_size + 1 == objective.module.model.get_input_embeddings().weight.shape[0]
    out = objective.write_export(tmp_path / "dlm", {"steps": 25})
    lm = load_diffusion_lm(str(out))
    assert lm.spec == objective.module.spec and lm.spec.mask_token_id == target.vocab_size
    assert lm.tokenizer.convert_tokens_to_ids("<|mask|>") == lm.spec.mask_token_id


def test_draftsmith_export_converts_to_hf_folder(tiny_target_dir, tmp_path):
    from draftsmith.export.format import write_export
    from draftsmith.runtime.target.diffusion_lm import DiffusionTargetError, folder_from_export

    target = Target.load(str(tiny_target_dir), "fp32")
    objective = build(recipe_config("diffusion_adapt", DIFFUSION), target)
    config = {**objective.export_config(), "target": target.identity()}
    write_export(tmp_path / "run" / "export", objective.module.state_dict(), config)
    with pytest.raises(DiffusionTargetError, match="is a draftsmith export, not a HF model folder"):
        load_diffusion_lm(str(tmp_path / "run" / "export"))
    out = folder_from_export(tmp_path / "run", tmp_path / "hf")  # a run folder works too
    lm = load_diffusion_lm(str(out))
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(lm.model(ids).logits, objective.module.model.eval()(ids).logits)
    # what the trainer writes now is already the HF folder: converting it again says to pass it
    # directly
    with pytest.raises(DiffusionTargetError, match="already a block-diffusion HF folder"):
        folder_from_export(out, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()
