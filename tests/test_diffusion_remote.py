"""Published diffusion LMs (LLaDA, Dream) load through ``load_diffusion_lm`` only with
``trust_remote_code`` and decode with full attention over the whole canvas. Tiny in-process
stand-ins of the same shape: their modelling code is written into the model folder (as the real ones
ship it), never fetched from a hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.runtime.decoding.diffusion import DiffusionDecodeConfig, diffusion_decode
from draftsmith.runtime.target.diffusion_lm import DiffusionTargetError, load_diffusion_lm

pytestmark = pytest.mark.unit

CONFIG_CODE = """
from transformers import PretrainedConfig


class TinyDLMConfig(PretrainedConfig):
    model_type = "MODEL_TYPE"

    def __init__(self, vocab_size=40, hidden_size=32, mask_token_id=39, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)
"""

MODEL_CODE = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tinydlm import TinyDLMConfig


class TinyDLM(PreTrainedModel):
    """Bidirectional over everything it is given (no mask argument), like LLaDA's and Dream's."""

    config_class = TinyDLMConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(512, config.hidden_size)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(config.hidden_size, 2, 64, dropout=0.0, batch_first=True)
            for _ in range(2)
        ])
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, **kwargs):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) + self.pos(positions)[None]
        for layer in self.layers:
            h = layer(h)
        return CausalLMOutput(logits=self.head(h))
'''

FAMILIES = {"llada": ("AutoModelForCausalLM", False), "dream": ("AutoModel", True)}


def write_remote_folder(path: Path, family: str, tokenizer) -> Path:
    """A folder laid out like a published diffusion LM: config with auto_map, its code, weights,
    tokenizer."""
    import importlib.util
    import sys

    auto_key, _ = FAMILIES[family]
    path.mkdir(parents=True)
    (path / "configuration_tinydlm.py").write_text(CONFIG_CODE.replace("MODEL_TYPE", family))
    (path / "modeling_tinydlm.py").write_text(MODEL_CODE)
    package = f"tinydlm_{family}"
    for name in (
        "configuration_tinydlm",
        "modeling_tinydlm",
    ):  # import the code once here to build the weights
        spec = importlib.util.spec_from_file_location(
            f"{package}.{name}", path / f"{name}.py", submodule_search_locations=None
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"{package}.{name}"] = module
        if package not in sys.modules:
            pkg = importlib.util.module_from_spec(
                importlib.util.spec_from_loader(package, loader=None, is_package=True)
            )
            pkg.__path__ = [str(path)]
            sys.modules[package] = pkg
        spec.loader.exec_module(module)
    config_cls = sys.modules[f"{package}.configuration_tinydlm"].TinyDLMConfig
    model_cls = sys.modules[f"{package}.modeling_tinydlm"].TinyDLM
    vocab = len(tokenizer) + 1
    torch.manual_seed(0)
    model = model_cls(
        config_cls(vocab_size=vocab, mask_token_id=vocab - 1, eos_token_id=tokenizer.eos_token_id)
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_tinydlm.TinyDLMConfig",
        auto_key: "modeling_tinydlm.TinyDLM",
    }
    config["model_type"] = family
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_decode(
    model, prompt: list[int], gen_length: int, block: int, mask_id: int, shift: bool
) -> list[int]:
    """LLaDA's semi-autoregressive loop written out: the whole canvas every step, one token per
    step, the most confident masked slot of the current block (Dream: position i-1 scores slot
    i)."""
    x = torch.tensor(prompt + [mask_id] * gen_length)[None]
    start = len(prompt)
    with torch.no_grad():
        for b in range(gen_length // block):
            lo, hi = start + b * block, start + (b + 1) * block
            for _ in range(block):
                logits = model(input_ids=x).logits[0].float()  # [T, V]
                if shift:
                    logits = torch.cat([logits[:1], logits[:-1]])
                logits[:, mask_id] = float("-inf")
                x0 = logits.argmax(-1)
                p = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
                conf = torch.full_like(p, -1.0)
                conf[lo:hi] = torch.where(
                    x[0, lo:hi] == mask_id, p[lo:hi], torch.full_like(p[lo:hi], -1.0)
                )
                j = int(conf.argmax())
                x[0, j] = x0[j]
    return x[0, start:].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_remote_family_needs_the_opt_in_then_decodes_like_the_reference_loop(
    family, tmp_path, tiny_tokenizer
):
    folder = write_remote_folder(tmp_path / family, family, tiny_tokenizer)
    with pytest.raises(DiffusionTargetError, match="--trust-remote-code"):
        load_diffusion_lm(str(folder))
    lm = load_diffusion_lm(str(folder), trust_remote_code=True)
    assert lm.spec.attention == "full" and lm.spec.shift is FAMILIES[family][1]
    assert lm.spec.mask_token_id == len(tiny_tokenizer)
    lm.spec = type(lm.spec)(
        4, lm.spec.mask_token_id, lm.spec.shift, "full"
    )  # 4-slot blocks: a short test
    prompt = [5, 9, 17, 4, 30]
    result = diffusion_decode(lm, prompt, DiffusionDecodeConfig(gen_length=12, steps_per_block=4))
    assert result.tokens == reference_decode(
        lm.model, prompt, 12, 4, lm.spec.mask_token_id, lm.spec.shift
    )
    assert result.steps == 12 and result.forwards == 12
    with pytest.raises(ValueError, match="cache off"):
        diffusion_decode(
            lm, prompt, DiffusionDecodeConfig(gen_length=12, steps_per_block=4, use_cache=True)
        )


def test_bench_refuses_the_cache_for_a_full_attention_target_before_decoding(
    tmp_path, tiny_tokenizer, capsys
):
    from draftsmith import cli

    folder = write_remote_folder(tmp_path / "llada", "llada", tiny_tokenizer)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n")
    rc = cli.main(
        [
            "bench",
            "--target",
            str(folder),
            "--trust-remote-code",
            "--prompts",
            str(prompts),
            "--gen-length",
            "32",
            "--cache",
            "both",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert (
        rc == 2 and "use --cache off" in capsys.readouterr().err and not (tmp_path / "b").exists()
    )


def test_a_draftsmith_folder_cannot_claim_full_attention():
    from draftsmith.runtime.target.diffusion_lm import DIFFUSION_KEY, spec_of

    block = {"block_length": 32, "mask_token_id": 5, "shift": True}
    assert spec_of({DIFFUSION_KEY: block}).attention == "block"
    with pytest.raises(DiffusionTargetError, match="block-causal"):
        spec_of({DIFFUSION_KEY: {**block, "attention": "full"}})


def test_bench_recognises_a_remote_family_folder(tmp_path, tiny_tokenizer):
    from draftsmith.cli.serving import _is_diffusion_target

    folder = write_remote_folder(tmp_path / "llada", "llada", tiny_tokenizer)
    assert _is_diffusion_target(str(folder)) and not _is_diffusion_target(str(tmp_path))
