"""Tool calls as models write them: which format a model uses, how a conversation with
tools is shown to it, how its calls are read back, and the grammar that forces one.

A model learns one way of calling a function, and its chat template shows it
(:func:`tool_format` reads which; :mod:`.formats` lists them, one module per family):

* ``hermes`` (Hermes, Qwen 2/2.5/3, SmolLM3, ...): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call;
* ``llama3`` (Llama 3.1+): the whole answer is ``{"name": ..., "parameters": {...}}``
  (after a ``<|python_tag|>`` control token, which renders as nothing);
* ``mistral``: ``[TOOL_CALLS]`` (a control token, so nothing in the text) and a JSON
  list of ``{"name": ..., "arguments": {...}}``;
* ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>value</parameter>...``;
* ``pythonic`` (Llama 4): ``[get_weather(city="Paris"), ...]``;
* ``deepseek_r1`` (DeepSeek V3, R1) and ``deepseek_v31``: calls between
  ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``;
* ``harmony`` (gpt-oss): a ``commentary`` message ``to=functions.NAME``;
* ``granite`` (Granite 3.x): ``<|tool_call|>`` and a JSON list;
* ``kimi_k2``: a ``<|tool_calls_section_begin|>`` section of ``functions.NAME:N`` calls;
* ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>``;
* ``command_r`` (Command R/R+: ``Action: ```json [...]```) and ``command_r7b``
  (``<|START_ACTION|>[...]<|END_ACTION|>``);
* ``generic``: a template that knows no tools. The tools and the ``hermes`` syntax are
  explained in a system message (:func:`generic_tool_prompt`), earlier calls and tool
  results are shown in that syntax, so any model can call a tool.

:class:`ToolCallParser` reads any of them from text as it streams; every API dialect
uses it. Where a format's markers are control tokens of the model (which a reply
shows as nothing), stage 0 finds them (:func:`control_tokens` over
:func:`tool_markers`), writes them into a forced call's grammar as those tokens and has
the last stage show them as text, so the parser sees them.
"""

from .base import ParsedCall
from .formats import ToolFormat, tool_format
from .grammar import control_tokens
from .hermes import HERMES_CLOSE, HERMES_OPEN
from .parser import ToolCallParser, forced_call_lark, tool_markers
from .prompts import generic_tool_prompt, template_messages

__all__ = [
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "ParsedCall",
    "ToolCallParser",
    "ToolFormat",
    "control_tokens",
    "forced_call_lark",
    "generic_tool_prompt",
    "template_messages",
    "tool_format",
    "tool_markers",
]
