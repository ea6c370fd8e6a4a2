"""The model-facing ``subagent`` tool, at the path DESIGN.md gives it: the tool's names from
:mod:`subagent.delegation`, where it lives with background delegation and tool results."""

from subagent.delegation import _subagent_tool
from subagent.delegation._subagent_tool import *  # noqa: F403

# Extended with `+=`, the form type checkers read as re-exporting a module's names.
__all__: list[str] = []
__all__ += _subagent_tool.__all__
