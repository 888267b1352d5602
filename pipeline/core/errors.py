"""The one base class of failures the user can act on (`UserError`): a stage ends on one with exit status 2 and
its message, without a traceback (`pipeline.core.stage.run_stage`). Every domain error that names a bad setting,
a missing or corrupt input, or a model that cannot be handled subclasses it."""

from __future__ import annotations


class UserError(RuntimeError):
    """A failure whose message already tells the user what to do (a setting, an input file, a model source)."""
