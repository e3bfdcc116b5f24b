"""A toy method as a newcomer adds one (docs/ADDING_A_METHOD.md), kept true by tests/test_method_table.py.

Files: ``toy_echo_head.py`` (the nn.Module), ``toy_echo_recipe.py`` (``build`` registered as a recipe),
``toy_echo.yaml`` (its config), ``toy_echo_proposer.py`` (its runtime proposer) and :data:`TOY_ECHO` (its method
table entry). A real method puts these at heads/|drafters/, recipes/, conf/recipe/, runtime/drafting/ and one
entry in common/methods.py; the toy lives under tests/ and registers only while a test needs it (:func:`install`).
"""

from __future__ import annotations

import importlib
import sys

from draftsmith.common.methods import METHODS, Method, register_method, unregister_method

TOY_ECHO = Method(
    name="toy_echo",
    label="Toy echo",
    family="heads",
    config="tests/toy_method/toy_echo.yaml",  # a real method: conf/recipe/<name>.yaml (the default)
    module="tests/toy_method/toy_echo_head.py",
    proposer="toy_echo",  # the export `method` its runtime proposer is registered for
    tests=("tests/test_method_table.py",),
)
_MODULES = ("toy_method.toy_echo_recipe", "toy_method.toy_echo_proposer")


def install() -> Method:
    """Register the toy's recipe, proposer and method table entry (importing the files registers them)."""
    for name in _MODULES:
        importlib.import_module(name)
    return register_method(TOY_ECHO)


def uninstall() -> None:
    """Undo :func:`install`, so the toy never leaks into other tests' view of the registries."""
    from draftsmith.recipes.registry import RECIPES
    from draftsmith.runtime.drafting.registry import _REGISTRY

    RECIPES.pop(TOY_ECHO.name, None)
    if TOY_ECHO.proposer in _REGISTRY:
        _REGISTRY.unregister(TOY_ECHO.proposer)
    if TOY_ECHO.name in METHODS:
        unregister_method(TOY_ECHO.name)
    for name in _MODULES:
        sys.modules.pop(name, None)
