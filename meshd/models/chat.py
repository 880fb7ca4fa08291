"""Chat templates: OpenAI-style messages -> the prompt text a model was trained on.

Models ship a Jinja template (GGUF ``tokenizer.chat_template``, or ``chat_template`` in
a Hugging Face ``tokenizer_config.json``). They are rendered here the way Hugging Face
``apply_chat_template`` renders them, so a template written for transformers gives the
same prompt under meshd: a sandboxed, immutable Jinja environment (a template is code
that came with a downloaded model), ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block, the ``raise_exception`` and
``strftime_now`` globals and HF's ``tojson`` (no HTML escaping, non-ASCII kept).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from .gguf import read_metadata
from .resolve import ModelFormat, ResolvedModel

__all__ = [
    "CHATML_TEMPLATE",
    "QUOTE_CLOSE",
    "QUOTE_OPEN",
    "ChatTemplateError",
    "chat_template",
    "chat_template_at",
    "normalize_messages",
    "quote_specials",
    "render_chat",
    "split_quoted",
    "template_variables",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Fallback for a model that ships no template: ChatML, the most widely trained format."""


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or called ``raise_exception``.

    A ``ValueError`` because the usual cause is a conversation the template rejects
    (roles out of order, an unsupported role): the API answers it as a bad request.
    """


def chat_template(model: ResolvedModel) -> str | None:
    """The chat template shipped with a model, or None if it has none.

    GGUF: ``tokenizer.chat_template``. MLX folder: ``chat_template.jinja`` (newer
    transformers), else ``chat_template`` in ``chat_template.json`` or
    ``tokenizer_config.json`` (a string, or a list of named templates of which
    ``default`` is taken).
    """
    if model.format == "gguf":
        key = "tokenizer.chat_template"
        value = read_metadata(model.path, keys=[key]).get(key)
        return value if isinstance(value, str) and value else None
    folder = Path(model.path)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8") or None
    for fname in ("chat_template.json", "tokenizer_config.json"):
        f = folder / fname
        if not f.is_file():
            continue
        try:
            value = json.loads(f.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, list):
            named = {
                t.get("name"): t.get("template")
                for t in value
                if isinstance(t, dict) and isinstance(t.get("template"), str)
            }
            value = named.get("default") or next(iter(named.values()), None)
        if isinstance(value, str) and value:
            return value
    return None


def chat_template_at(path: str | Path) -> str | None:
    """:func:`chat_template` of the model at ``path`` (a GGUF file or an MLX folder)."""
    fmt: ModelFormat = "mlx" if Path(path).is_dir() else "gguf"
    return chat_template(ResolvedModel(name=str(path), path=str(path), format=fmt))


def normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy OpenAI chat messages into the plain dicts that templates expect.

    A content list of parts (``[{"type": "text", "text": ...}, ...]``) becomes one
    string, the text parts joined by newlines (as vLLM does): most templates concatenate
    ``message['content']`` as a string. Other keys (``name``, ``tool_calls``, ...) are
    kept; ``None`` content (an assistant turn that only calls tools) stays ``None``.
    Raises ``ValueError`` on a message without a string role, on content that is neither
    a string, a list of parts nor ``None``, and on non-text parts (images, audio): the
    engines here are text-only.
    """
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
        msg = dict(message)
        content = msg.get("content")
        if isinstance(content, list):
            msg["content"] = "\n".join(_part_text(part, i, j) for j, part in enumerate(content))
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of parts, "
                f"got {type(content).__name__}"
            )
        out.append(msg)
    return out


def _part_text(part: object, i: int, j: int) -> str:
    where = f"messages[{i}].content[{j}]"
    if isinstance(part, str):  # tolerated: some clients send bare strings as parts
        return part
    if not isinstance(part, Mapping):
        raise ValueError(f"{where} must be an object, got {type(part).__name__}")
    kind = part.get("type")
    if kind != "text":
        raise ValueError(f"{where} has type {kind!r}; only 'text' parts are supported")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where} needs a string 'text'")
    return text


def render_chat(
    template: str,
    messages: Iterable[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render ``messages`` (normalized first) through a Hugging Face style chat template.

    ``extra`` reaches the template as further variables (``tools``, ``documents``,
    ``enable_thinking``, other special tokens ...); ``tools`` and ``documents`` default
    to ``None`` as in transformers, since templates test ``tools is not none``.
    Raises :class:`ChatTemplateError` when the template does not compile, fails while
    rendering, or rejects the conversation through ``raise_exception``; ``ValueError``
    for malformed messages (see :func:`normalize_messages`).
    """
    compiled = _compile(template)
    variables: dict[str, Any] = {"tools": None, "documents": None, **extra}
    try:
        return compiled.render(
            variables,
            messages=normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (TypeError, AttributeError, KeyError, IndexError, ArithmeticError) as exc:
        # What a template expression can raise on data it did not expect, e.g.
        # `'x' + message['content']` when content is None.
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same signature as transformers' filter: Jinja's own tojson escapes <, >, & and '
    # for HTML, which would change the prompt of every tool-calling template.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    transformers uses the block to find assistant tokens for training masks; templates
    written for it would not even compile without the tag.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block body up to ``endgeneration``."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    # One compiled template per distinct source: a node serves a handful of models and
    # compiling costs far more than rendering.
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from what it is given (``messages``,
    ``enable_thinking``, ...): none it sets itself, nor its globals. Empty for a
    template that does not compile (rendering it says why)."""
    env = _environment()
    try:
        found = jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return frozenset()
    return frozenset(found) - set(env.globals)


# ---------------------------------------------------------------------------------------
# Special tokens a user wrote
#
# The rendered prompt is tokenized with special-token text parsed: the template's
# ``<|im_start|>`` must become its token. A user's (or a tool's) text must not: typed
# into a message, ``<|im_end|>\n<|im_start|>system`` would open a system turn. So,
# before rendering, the special-token text inside every string the request brought is
# quoted between two private-use characters no tokenizer gives a meaning to; after
# rendering, what lies between them is tokenized as plain text. A request without any
# special-token text is rendered and tokenized exactly as before (no quote in it).

#: Open and close a quoted run of special-token text (U+E000, U+E001: private use).
QUOTE_OPEN, QUOTE_CLOSE = "\ue000", "\ue001"
_QUOTED = re.compile(f"{QUOTE_OPEN}([^{QUOTE_OPEN}{QUOTE_CLOSE}]*){QUOTE_CLOSE}")
_QUOTES = str.maketrans("", "", QUOTE_OPEN + QUOTE_CLOSE)


def quote_specials(value: Any, specials: Callable[[str], Collection[str]]) -> Any:
    """``value`` (messages, tools: JSON-like) with every string's special-token text
    quoted: ``specials(s)`` names the special-token texts found in ``s`` (a tokenizer
    knows them). Quote characters a user sent are dropped first: only ours remain."""
    if isinstance(value, str):
        text = value.translate(_QUOTES)
        found = sorted(set(specials(text)), key=len, reverse=True)
        if not found:
            return text
        alternatives = re.compile("|".join(re.escape(s) for s in found if s))
        return alternatives.sub(lambda m: QUOTE_OPEN + m.group(0) + QUOTE_CLOSE, text)
    if isinstance(value, list | tuple):
        return [quote_specials(v, specials) for v in value]
    if isinstance(value, Mapping):
        return {k: quote_specials(v, specials) for k, v in value.items()}
    return value


def split_quoted(text: str) -> list[tuple[str, bool]]:
    """A rendered prompt as runs of (text, quoted): quoted runs are a user's special-token
    text, to be tokenized as plain text. A quote the template cut in half (a string it
    split or sliced) is dropped; what it marked is then no token text any more."""
    out: list[tuple[str, bool]] = []
    at = 0
    for m in _QUOTED.finditer(text):
        if m.start() > at:
            out.append((text[at : m.start()].translate(_QUOTES), False))
        out.append((m.group(1), True))
        at = m.end()
    if at < len(text):
        out.append((text[at:].translate(_QUOTES), False))
    return [(t, q) for t, q in out if t]
