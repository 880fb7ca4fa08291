"""The images of one request, together: a 400 past :data:`MAX_IMAGE_BYTES` (each
image is checked where it is parsed, :mod:`meshd.api.images`)."""

from __future__ import annotations

from .errors import bad_request
from .images import MAX_IMAGE_BYTES

__all__ = ["check_images"]


def check_images(images: list[bytes], param: str = "messages") -> None:
    """A 400 (:class:`ApiError`, in the caller's dialect) when one request's images
    together pass :data:`MAX_IMAGE_BYTES`."""
    total = sum(len(b) for b in images)
    if total > MAX_IMAGE_BYTES:
        raise bad_request(
            f"the images of one request may take {MAX_IMAGE_BYTES} bytes in all, "
            f"these take {total}",
            param=param,
        )
