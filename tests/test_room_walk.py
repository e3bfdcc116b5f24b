"""What docs/ARCHITECTURE.md says about how a method and its data travel stays true: the method
footprint (docs/tools/method_footprint.py: the places and rooms one method spans, from its
registrations) stays small, and the data paths (docs/tools/room_walk.py: the functions a training
run's and a bench's data pass through, traced) are current."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# No method's code spans more than a module, a recipe package, a config, a proposer family and one
# converter per engine format (EAGLE-3 and DFlash: 7 places in 5 rooms today). A method that needs
# more has a list to edit somewhere.
MOST_FILES, MOST_ROOMS = 7, 5


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ the footprint
def test_every_method_footprint_names_existing_places_in_few_rooms():
    result = load_script("method_footprint").footprints()
    assert result, "no recipe registered"
    for name, found in result.items():
        places = [p for part in found["parts"].values() for p in part]
        assert all((ROOT / p).exists() for p in places), (
            name,
            [p for p in places if not (ROOT / p).exists()],
        )
        assert found["files"] <= MOST_FILES and len(found["rooms"]) <= MOST_ROOMS, (name, found)
    eagle3 = result["eagle3"]["parts"]
    assert eagle3["recipe"] == ["recipes/eagle3/"] and eagle3["proposer"] == [
        "runtime/drafting/eagle.py"
    ]
    assert (
        "export/speculators.py" in eagle3["converters"] and result["medusa"]["parts"]["converters"]
    )


def test_a_recipe_package_owns_its_files():
    owned = load_script("method_footprint").method_owned()
    assert {"recipes/dflash/objective.py", "recipes/dflash/cut.py", "heads/medusa.py"} <= owned


# ------------------------------------------------------------------------------------ the data path
def test_data_is_a_tensor_or_a_container_holding_one():
    walk = load_script("room_walk")
    assert walk.carries_data(torch.zeros(2))
    assert walk.carries_data({"input_ids": torch.zeros(2)}) and walk.carries_data(
        [(1, torch.zeros(1))]
    )
    assert not walk.carries_data({"spec": "chat.jsonl", "limit": 3}) and not walk.carries_data(ROOT)


def test_the_tracer_keeps_data_calls_folds_same_file_calls_and_shows_each_function_once(
    tmp_path, monkeypatch
):
    walk = load_script("room_walk")
    (tmp_path / "first.py").write_text(
        textwrap.dedent("""
        import second

        def entry(n):
            for _ in range(n):
                helper()
            return second.no_data(3)

        def helper():
            import torch
            return second.scale(torch.ones(2))
    """)
    )
    (tmp_path / "second.py").write_text(
        textwrap.dedent("""
        def scale(x):
            return twice(x)

        def twice(x):
            return 2 * x

        def no_data(k):
            return k + 1
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        walk,
        "repository_file",
        lambda path: Path(path).name if Path(path).parent == tmp_path else None,
    )
    import first

    tracer = walk.Tracer(("first.py", "entry"))
    sys.setprofile(tracer)
    try:
        first.entry(2)
    finally:
        sys.setprofile(None)
    # helper is folded into entry (same file), twice into scale; no_data never touches a tensor:
    # pruned
    assert walk.lines_of(walk.pruned(tracer.root)) == ["first.py  entry", "  second.py  scale"]


@pytest.mark.e2e  # a training run and a bench, each traced in a subprocess (minutes)
def test_the_data_paths_in_architecture_are_current(tmp_path):
    walk, docs = load_script("room_walk"), load_script("module_table")
    result = walk.measure(tmp_path / "work")
    training = walk.lines_of(result["training"]["tree"])
    serving = walk.lines_of(result["serving"]["tree"])
    for needed in (
        "distill/engine/module.py  DistillModule.training_step",
        "distill/target/frozen.py  Target.features",
        "export/format.py  write_export",
    ):
        assert any(line.strip() == needed for line in training), (needed, training)
    for needed in (
        "runtime/serving.py  load_runtime",
        "runtime/decoding/speculative.py  SpeculativeDecoder.generate",
    ):
        assert any(line.strip() == needed for line in serving), (needed, serving)
    assert not any(
        line.split()[0].startswith(("distill/", "recipes/")) for line in serving
    )  # serving never trains
    assert docs.part(docs.DOC.read_text(), "data-path") == walk.markdown(result), (
        "docs/ARCHITECTURE.md's data paths are stale: run `.venv/bin/python docs/tools/room_walk.py"
        " --write`"
    )
