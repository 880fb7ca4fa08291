"""Text from the network, made safe to show: names, reasons, model names.

A joiner names itself, a member writes its card, a runner reports a reason: any of it
may carry newlines (a forged log line), terminal escapes (``ESC]...``: a title, a
cleared screen, a hyperlink), bidi overrides (``evil\u202egnp.exe``) or a megabyte.
Every sink that shows such text (log lines, ``meshctl`` tables, ``top``) passes it
through :func:`printable` or, for a whole log message, :func:`loggable`.
"""

from __future__ import annotations

import unicodedata

__all__ = ["DISPLAY_LIMIT", "loggable", "printable"]

#: Characters of a name or reason shown at most (an ellipsis marks the cut).
DISPLAY_LIMIT = 80
_REPLACEMENT = "\ufffd"


def _unsafe(ch: str) -> bool:
    # Cc: C0/C1 controls, DEL, ESC; Cf: bidi overrides and isolates, zero-width
    # characters; Cs/Co/Cn: surrogates, private use, unassigned; Zl/Zp: the Unicode
    # line and paragraph separators (newlines to some terminals and viewers).
    if " " <= ch < "\x7f":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def printable(value: object, limit: int = DISPLAY_LIMIT) -> str:
    """``value`` as one line safe on a terminal: every control, format or unassigned
    character replaced by U+FFFD, at most ``limit`` characters."""
    text = str(value)
    if len(text) <= limit and text.isascii() and text.isprintable():
        return text  # the usual case, checked at C speed
    cut = len(text) > limit
    if cut:
        text = text[: max(limit - 1, 0)]
    text = "".join(_REPLACEMENT if _unsafe(ch) else ch for ch in text)
    return text + "\u2026" if cut else text


def loggable(message: str) -> str:
    """A log message that stays one record: unsafe characters written as escapes
    (``\\x1b``, ``\\u202e``: the log keeps what was sent), a newline continued on an
    indented line (a name cannot start a line that looks like a record of its own)."""
    if message.isascii() and message.isprintable():
        return message  # the usual case, checked at C speed
    out = []
    for ch in message:
        if ch == "\n":
            out.append("\n    ")
        elif ch == "\t" or not _unsafe(ch):
            out.append(ch)
        else:
            out.append(_escape(ord(ch)))
    return "".join(out)


def _escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
