"""Parameter names: the policy's names mapped to the engine's before a bucket is sent."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch


@attrs.frozen
class NameMap:
    """Renames a policy's parameters to an engine's, and drops the ones the engine lacks.

    Owned by the policy plugin (it knows its layout); engines only ever see their own names.
    ``rename`` maps exact names; ``prefixes`` replaces leading prefixes (first match wins);
    names in ``drop`` (after renaming) are not sent.
    """

    rename: dict[str, str] = attrs.field(factory=dict)
    prefixes: tuple[tuple[str, str], ...] = ()
    drop: frozenset[str] = frozenset()

    def __call__(self, name: str) -> str | None:
        """The engine's name for ``name``, or None when it is not sent."""
        if name in self.rename:
            name = self.rename[name]
        else:
            for old, new in self.prefixes:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
        return None if name in self.drop else name

    def apply(self, bucket: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``bucket`` with engine names; dropped entries removed."""
        out = {}
        for name, tensor in bucket.items():
            mapped = self(name)
            if mapped is not None:
                out[mapped] = tensor
        return out
