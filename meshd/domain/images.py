"""Image files as requests bring them: which formats are read, told by their first
bytes. Checked at the API node for the caller's error, and again at stage 0, which
reads only what a member sent it (llama.cpp's helper would hand any other bytes to a
video decoder it finds on the PATH)."""

from __future__ import annotations

__all__ = ["IMAGE_FORMATS", "image_format"]

#: File signatures of the formats llama.cpp's image reader (stb_image) decodes.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
#: The formats read, as the errors name them.
IMAGE_FORMATS = "PNG, JPEG, GIF, BMP"


def image_format(raw: bytes) -> str | None:
    """The format ``raw`` starts as (``PNG``, ``JPEG``...), or None."""
    return next((name for sig, name in _SIGNATURES if raw.startswith(sig)), None)
