"""The in-process agent runtime behind the ``spawn`` and ``fork`` providers and ``subagent serve``.

An :class:`Agent` holds a message log, a persona, tools and an LLM adapter, and runs turns:
model call, tool calls, model call, until the model answers without tools. Adapters stream
completions (:class:`ScriptedLlm` for tests and the demo; ``subagent.runtime.openai`` for any
OpenAI-compatible chat-completions server).

The package exports what each of its modules lists in its own ``__all__``: the agent and its events
(``agent``), the adapter protocol, registry and errors (``llm``), the conversation records
(``messages``), the scripted adapter (``scripted``) and tools (``tools``). The OpenAI adapter is
imported on its own, as ``subagent.runtime.openai``, so that httpx loads only where it is used.
"""

from __future__ import annotations

from subagent.runtime import _inprocess_agent, _llm, _messages, _scripted, _tools
from subagent.runtime._inprocess_agent import *  # noqa: F403
from subagent.runtime._llm import *  # noqa: F403
from subagent.runtime._messages import *  # noqa: F403
from subagent.runtime._scripted import *  # noqa: F403
from subagent.runtime._tools import *  # noqa: F403

# Extended with `+=`, the form type checkers read as re-exporting a submodule's names.
__all__: list[str] = []
__all__ += _inprocess_agent.__all__
__all__ += _llm.__all__
__all__ += _messages.__all__
__all__ += _scripted.__all__
__all__ += _tools.__all__
