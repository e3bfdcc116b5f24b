"""One way to rebuild a trained module from its export folder: the :class:`Exportable` mixin.

Every exported module (heads/, drafters/, controllers/) names its export ``method``, its
architecture dataclass (``config_class``) and how its constructor takes the target weights it shares
(never stored in the export). Loading is then always ``Module.from_export(export_dir,
**shared_weights) -> (module, export config)``: the recorded method must be the module's, the
architecture must be one ``config_class`` knows, and the state dict must fit exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from draftsmith.export.format import ExportError, read_export
from draftsmith.export.integrity_check import verify_identity
from draftsmith.export.schema import RELABEL_FIX, check_architecture, relabel_claim

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass
class ExportContents:
    """What ``from_export`` read: the folder, its ``config.json`` and its main weight part."""

    path: Path
    config: dict[str, Any]
    state: dict[str, torch.Tensor]


class Exportable:
    """Mixin for an ``nn.Module`` that is written to and rebuilt from a draftsmith export.

    Subclasses set ``method`` (the ``config.json`` method key; ``also_loads`` lists further methods
    whose exports hold the same module, e.g. ``medusa2`` for Medusa heads) and ``config_class`` (the
    architecture dataclass, kept as ``self.config``). ``_build`` turns architecture + weights + the
    shared target weights into an unloaded module; the default calls ``cls(architecture,
    **shared_weights)``.
    """

    method: ClassVar[str]
    also_loads: ClassVar[tuple[str, ...]] = ()
    config_class: ClassVar[type]
    # True: architecture keys the config_class does not know are ignored (the export records extra
    # context there).
    extra_architecture_keys: ClassVar[bool] = False
    # Keys the module has but an export never stores (e.g. a shared LM head registered
    # persistently).
    unexported_keys: ClassVar[tuple[str, ...]] = ()
    # The target tensors ``from_export`` needs, by their attribute name on a target (distill Target
    # / runtime model).
    target_weights: ClassVar[tuple[str, ...]] = ()
    config: Any

    def architecture(self) -> dict[str, Any]:
        """Architecture block of the export config (the ``config_class`` fields)."""
        return asdict(self.config)

    @classmethod
    def from_export(
        cls, export_dir: str | Path, **shared_weights: Any
    ) -> tuple[Self, dict[str, Any]]:
        """Rebuild the module of ``export_dir`` -> (module in eval mode, export config).

        ``shared_weights`` are the target tensors (or layers, or target facts to check) the
        constructor takes and the export does not store. Raises ExportError when the folder holds
        another method, an architecture this ``config_class`` does not know, an identity that no
        longer matches (``verify_identity``: method, architecture and weight shapes checked as one),
        or weights with missing or unexpected keys.
        """
        config, state = read_export(export_dir, verify=False)
        export = ExportContents(Path(export_dir), config, state)
        cls._check_method(export)
        architecture = cls._architecture_of(export)
        # After the two checks above, whose messages name the module class: what they let through (a
        # method edited to another whose layout fits) the identity recorded at export refuses.
        verify_identity(export_dir, config)
        module = cls._build(architecture, export, **shared_weights)
        load_exported_state(module, export, cls.unexported_keys)
        return module.eval(), export.config

    @classmethod
    def from_export_on(
        cls, export_dir: str | Path, target: Any, **shared_weights: Any
    ) -> tuple[Self, dict[str, Any]]:
        """``from_export`` with the ``target_weights`` taken from ``target``'s attributes of those
        names."""
        taken = {
            name: getattr(target, name) for name in cls.target_weights if name not in shared_weights
        }
        return cls.from_export(export_dir, **taken, **shared_weights)

    @classmethod
    def _build(cls, architecture: Any, export: ExportContents, **shared_weights: Any) -> Self:
        """The module for ``architecture`` before its weights are loaded (override when the
        constructor differs)."""
        return cls(architecture, **shared_weights)

    @classmethod
    def _check_method(cls, export: ExportContents) -> None:
        found = export.config.get("method")
        accepted = (cls.method, *cls.also_loads)
        if found not in accepted:
            raise ExportError(
                f"{export.path} holds a {found!r} export, not {' or '.join(accepted)} "
                f"({cls.__name__})"
            )

    @classmethod
    def _architecture_of(cls, export: ExportContents) -> Any:
        arch = dict(export.config.get("architecture") or {})
        known = {f.name for f in fields(cls.config_class)}
        # The method names the module, the architecture its shape: when they disagree, config.json's
        # "method" was edited or another draftsmith version wrote the export. One line names the
        # export, the method and the fields.
        check_architecture(cls, export.config, export.path)
        try:
            return cls.config_class(**{k: v for k, v in arch.items() if k in known})
        except (TypeError, ValueError) as err:
            raise ExportError(
                f"{relabel_claim(export.path, export.config)} does not make a "
                f"{cls.config_class.__name__} ({err}); {RELABEL_FIX}"
            ) from err


def load_exported_state(
    module: nn.Module, export: ExportContents, unexported: tuple[str, ...] = ()
) -> None:
    """Load ``export.state`` into ``module`` strictly: missing (except ``unexported`` prefixes) or
    unexpected keys raise ExportError naming the export and the keys (non-persistent buffers are
    never in exports).
    """
    own = module.state_dict()
    for (
        name,
        tensor,
    ) in export.state.items():  # a config.json edited against its weights: named, not torch's text
        if name in own and tuple(own[name].shape) != tuple(tensor.shape):
            raise ExportError(
                f"{export.path} ({export.config.get('method')}): config.json's architecture gives"
                f" {name} the shape {list(own[name].shape)}, the weights hold {list(tensor.shape)}:"
                " the config and the weights disagree; restore the config.json written with them,"
                " or re-export it"
            )
    missing, unexpected = module.load_state_dict(export.state, strict=False)
    missing = [k for k in missing if not k.startswith(unexported)] if unexported else list(missing)
    if missing or unexpected:
        raise ExportError(
            f"{export.path} ({export.config.get('method')}): weights do not match the architecture"
            f" (missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected"
            f" {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}); re-export it"
        )


__all__ = ["ExportContents", "Exportable", "load_exported_state"]
