"""What a parallelism changes on the user's live model (`install`), and putting it back."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Change:
    module: object  # the module changed
    attribute: str  # "__class__" (its class replaced by a subclass) or an attribute it holds
    old: object  # what it was before


def undo(changes: list[Change]) -> None:
    """Put back what `changes` changed, the last change first."""
    for change in reversed(changes):
        if change.attribute == "__class__":
            change.module.__class__ = change.old
        else:
            setattr(change.module, change.attribute, change.old)
