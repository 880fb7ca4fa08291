"""The parts of a chat completions message's content: text, and images as data URLs
(``image_url``), flattened the way every layer below passes a turn on: one string with
an :data:`IMAGE_MARKER` where each image goes, and the images' bytes beside it."""

from __future__ import annotations

import msgspec

from meshd.domain.chat import IMAGE_MARKER, image_text

from .images import url_image
from .rules import FieldError
from .rules import unsupported as _unsupported

__all__ = ["ContentPart", "ImageUrl", "parts_images", "parts_text"]


class ImageUrl(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``image_url`` of an image part: a ``data:`` URL (nodes never fetch a remote one)."""

    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One part of a message's content: ``{"type": "text", "text": ...}``, or an image
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``.

    ``type`` is a plain string (not a Literal) so that an audio or file part gets a
    message that says why, rather than a bare enum error.
    """

    type: str
    text: str | None = None
    #: An image part's URL (some clients send the URL as a bare string).
    image_url: ImageUrl | str | None = None

    def __post_init__(self) -> None:
        if self.type == "image_url":
            if self.image_url is None:
                raise FieldError("image_url", "an image_url part needs `image_url.url`")
            url_image(self.url, "image_url")  # checked here, where the error names it
            return
        if self.type != "text":
            raise _unsupported(
                "type",
                f"content part type {self.type!r} is not supported; "
                "meshd reads 'text' and 'image_url' parts",
            )
        if self.text is None:
            raise FieldError("text", "a text content part needs a string `text`")

    @property
    def url(self) -> str:
        """An image part's URL."""
        u = self.image_url
        return u.url if isinstance(u, ImageUrl) else u or ""


def parts_text(content: str | list[ContentPart] | None) -> str:
    """``content`` as one string: text parts joined by newlines, each image part as the
    :data:`IMAGE_MARKER` of its place (a user's own markers dropped), ``""`` for none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return image_text(content)
    return "\n".join(
        IMAGE_MARKER if part.type == "image_url" else image_text(part.text or "")
        for part in content
    )


def parts_images(content: str | list[ContentPart] | None) -> list[bytes]:
    """The bytes of ``content``'s image parts, in order."""
    if not isinstance(content, list):
        return []
    return [url_image(p.url, "image_url") for p in content if p.type == "image_url"]
