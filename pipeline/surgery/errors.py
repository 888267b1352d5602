"""The errors model surgery raises for a model or setting it cannot handle."""

from __future__ import annotations

from pipeline.core.errors import UserError


class PruneError(UserError):
    """A model or setting the pruner cannot handle."""


class DistillError(UserError):
    """A teacher or setting the student cannot be built from."""
