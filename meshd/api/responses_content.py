"""The content parts of a Responses input item: text (``input_text``, ``output_text``)
and images as data URLs (``input_image``), flattened as chat turns carry them: one
string with an :data:`IMAGE_MARKER` where each image goes, the images' bytes beside."""

from __future__ import annotations

import msgspec

from meshd.domain.chat import IMAGE_MARKER, image_text

from .images import url_image
from .rules import FieldError, unsupported

__all__ = ["InputContent", "content_images", "content_text"]

#: Content part types that are text (``output_text``: an assistant message sent back).
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class InputContent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One part of an input message's content. Checked by the item that holds it: a
    ``reasoning`` item's parts are skipped, whatever their type."""

    type: str
    text: str | None = None
    #: An ``input_image`` part's data URL (nodes never fetch a remote one).
    image_url: str | None = None


def content_text(content: str | list[InputContent], field: str) -> str:
    """``content`` as one string (text parts joined by newlines, as chat joins them,
    an ``input_image`` part as the :data:`IMAGE_MARKER` of its place), or a
    FieldError naming the first part that is neither."""
    if isinstance(content, str):
        return image_text(content)
    for i, part in enumerate(content):
        if part.type == "input_image" and field == "content":
            url_image(part.image_url or "", f"{field}[{i}].image_url")
            continue
        if part.type not in _TEXT_PARTS:
            raise unsupported(
                f"{field}[{i}].type",
                f"content part type {part.type!r} is not supported; meshd reads "
                "'input_text' and 'input_image' parts",
            )
        if part.text is None:
            raise FieldError(f"{field}[{i}].text", "a text content part needs a string `text`")
    return "\n".join(
        IMAGE_MARKER if part.type == "input_image" else image_text(part.text or "")
        for part in content
    )


def content_images(content: str | list[InputContent] | None) -> list[bytes]:
    """The bytes of ``content``'s ``input_image`` parts, in order."""
    if not isinstance(content, list):
        return []
    return [url_image(p.image_url or "", "image_url") for p in content if p.type == "input_image"]
