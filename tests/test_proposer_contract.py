"""The declared proposer interface: nothing outside a family's own file probes a proposer, every
family module is loaded by the registry and registers the methods it serves, builders refuse unknown
options, and a builder's result must subclass the declared base."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from draftsmith.runtime.drafting import registry
from draftsmith.runtime.drafting.base import NullProposer, Proposer, ProposerWrapper
from draftsmith.runtime.drafting.chain import ChainProposer
from draftsmith.runtime.drafting.registry import build_proposer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".venv", ".cache", ".git", "tests", "node_modules", "build", "dist"}
# A getattr / hasattr on a proposer (or the proposer a wrapper holds), or a private member of one
# replaced.
PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:[\w.]*\.)?(?:\w*proposer|inner|base)\s*,")
REPLACED = re.compile(r"\bproposer\._\w+\s*=|\bdel\s+[\w.]*proposer\._")


def _project_sources() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if d not in SKIP and not d.startswith(".")
        ]  # never walk into the venvs
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return found


def _family_file(path: Path) -> bool:
    """runtime/drafting/<family>.py: a family may read its own objects however it likes."""
    rel = path.relative_to(ROOT).parts
    return rel[:2] == ("runtime", "drafting") and path.stem not in ("base", "registry", "__init__")


def test_nothing_outside_a_family_probes_a_proposer():
    found = []
    for path in _project_sources():
        if _family_file(path):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PROBE.search(line) or REPLACED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == [], (
        "read the declared members of runtime/drafting/base.Proposer instead:\n" + "\n".join(found)
    )


def test_the_probe_pattern_catches_what_it_is_for():
    assert PROBE.search('taps = getattr(self.proposer, "feature_taps", ())')
    assert PROBE.search('x = getattr(base, "reads_logits", True)')
    assert PROBE.search('hasattr(spec.proposer, "draft_plan")')
    assert REPLACED.search("proposer._draft = counted") and REPLACED.search("del proposer._draft")
    assert not PROBE.search('getattr(model, "argmax_head", False)')  # targets are not proposers


def test_every_family_module_is_loaded_and_registers_what_it_serves():
    """A family module the registry does not import would serve nothing: each file of
    runtime/drafting/ that registers a builder is imported by ``load_families``, and registers under
    its own name what recipes declare.
    """
    import sys

    registry.load_families()
    registering = sorted(
        p.stem
        for p in (ROOT / "runtime" / "drafting").glob("*.py")
        if "register_proposer(" in p.read_text() and p.stem not in ("base", "registry")
    )
    assert (
        registering
        and [m for m in registering if f"{registry.__package__}.{m}" not in sys.modules] == []
    )
    assert registry.proposer_module("hydra_pp") == "draftsmith.runtime.drafting.hydra"
    assert registry.proposer_module("eagle3") == "draftsmith.runtime.drafting.eagle"


def test_unknown_options_are_refused_with_the_valid_ones(medusa_export, tiny_target_dir):
    from draftsmith.runtime.target.loading import load_decoder

    target = load_decoder(tiny_target_dir)
    with pytest.raises(
        ValueError,
        match=r"unknown --proposer-option depht for the medusa proposer; valid: tree, " r"top_k",
    ):
        build_proposer(medusa_export, target, depht=2)
    assert build_proposer(medusa_export, target, top_k=4).tree.top_k == 4
    for method in (
        "medusa",
        "medusa2",
        "hydra",
        "hydra_pp",
        "clover2",
    ):  # fixed option lists, checked centrally
        assert registry.builder_options(registry._REGISTRY.get(method)) == ("tree", "top_k")
    # ignores all: refuses all
    assert registry.builder_options(lambda export_dir, config, target, **_: None) == ()
    # checks its own
    assert registry.builder_options(lambda export_dir, config, target, **options: None) is None


def test_a_builder_must_return_a_declared_proposer(tmp_path, tiny_target_dir):
    from draftsmith.export.format import write_export
    from draftsmith.runtime.target.loading import load_decoder

    class Duck:  # drafts, but declares nothing
        max_tree_nodes = 1

    registry.register_proposer("duck_test")(lambda export_dir, config, target_model: Duck())
    try:
        config = {
            "method": "duck_test",
            "architecture": {},
            "target": {"name_or_path": str(tiny_target_dir)},
        }
        export = write_export(tmp_path / "duck", {"w": torch.zeros(1)}, config)
        with pytest.raises(
            TypeError, match="does not subclass draftsmith.runtime.drafting.base.Proposer"
        ):
            build_proposer(export, load_decoder(tiny_target_dir))
    finally:
        registry._REGISTRY.unregister("duck_test")


def test_the_base_declares_every_member_with_a_default():
    plain = NullProposer()
    assert (plain.feature_taps, plain.reads_logits, plain.shape_family, plain.draft_plan) == (
        (),
        True,
        "depth",
        {},
    )
    assert (
        plain.wrap_target("model") == "model"
        and not plain.counts_draft_calls
        and plain.draft_calls == 0
    )
    with pytest.raises(ValueError, match="drafts its export's shape only"):
        plain.reshape({"depth": 2})
    chain = ChainProposer(lambda ids: torch.zeros(8), depth=3)
    wrapped = ProposerWrapper(chain)
    assert (
        isinstance(wrapped, Proposer)
        and wrapped.max_tree_nodes == 4
        and wrapped.reads_logits is False
    )
    # a wrapper keeps its export's shape
    assert chain.draft_depth == 3 and wrapped.draft_depth is None
