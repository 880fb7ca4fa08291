"""Images as the dialects send them, checked once: OpenAI ``image_url`` data URLs
(and Responses ``input_image``), Ollama's base64 ``images``, Anthropic's base64
``image`` sources. Each becomes the file's bytes; what the model sees of it is stage
0's business (its projector, see ``meshd.engines.projector``).

Nodes never fetch: a remote ``http(s)`` URL is refused with a 400 that says to send
the image inline. Bad base64, a file that is no image stage 0 can read, and images
over :data:`MAX_IMAGE_BYTES` in one request are 400s naming the field.
"""

from __future__ import annotations

import base64
import binascii
import re

from meshd.domain.chat import IMAGE_MARKER, ChatTurn, ToolCallTurn, image_text
from meshd.domain.images import IMAGE_FORMATS, image_format

from .rules import FieldError

__all__ = ["MAX_IMAGE_BYTES", "image_bytes", "image_turn", "url_image"]

#: Images of one request, bytes in all: the request travels to stage 0 in one control
#: frame (``wire.MAX_CONTROL_FRAME``, 4 MiB) with its text.
MAX_IMAGE_BYTES = 3 * 1024 * 1024

_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),(.*)", re.DOTALL)
_SPACE = re.compile(r"\s+")


def image_bytes(data: str, param: str) -> bytes:
    """The image that ``data`` (base64) holds; FieldError on ``param`` when it is no
    base64 or no image of a format stage 0 reads."""
    try:
        raw = base64.b64decode(_SPACE.sub("", data), validate=True)
    except (binascii.Error, ValueError):
        raise FieldError(param, f"{param} is not valid base64") from None
    if image_format(raw) is None:
        raise FieldError(param, f"{param} is not an image meshd reads ({IMAGE_FORMATS})")
    return raw


def url_image(url: str, param: str) -> bytes:
    """The image of an ``image_url``: a ``data:`` URL with base64 content. A remote URL
    is refused: nodes do not fetch (a server that fetched what a request names could
    be made to reach anything the node reaches)."""
    lowered = url[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise FieldError(
            param,
            "remote image URLs are not fetched: meshd nodes never download what a "
            "request names; send the image inline as a data URL "
            "(data:image/png;base64,...)",
        )
    m = _DATA_URL.fullmatch(url)
    if m is None or not lowered.startswith("data:"):
        raise FieldError(param, f"{param} must be a data URL (data:image/png;base64,...)")
    if ";base64" not in m.group(2).lower():
        raise FieldError(param, f"{param} must be base64 (data:image/png;base64,...)")
    return image_bytes(m.group(3), param)


def image_turn(
    role: str, text: str, images: list[str] | None, calls: list[ToolCallTurn] | None = None,
    name: str | None = None, thinking: str | None = None,
) -> ChatTurn:  # fmt: skip
    """An Ollama message as a chat turn: its base64 ``images`` (checked when the body
    was parsed) placed before its text, as Ollama places them."""
    found = [image_bytes(data, "images") for data in images or ()]
    marked = IMAGE_MARKER * len(found) + image_text(text)
    return ChatTurn(role, marked, calls or [], None, name, thinking, found)
