"""The weights plane's messages: a node fetches a stage's slice from the nodes that
hold the model (``meshd.transport.weights_server`` and ``weights_pull``). Re-exported
by :mod:`.wire`, which decodes them."""

from __future__ import annotations

import msgspec

from meshd.domain.facts import Sha256

__all__ = [
    "MAX_TRANSFER_HEADER",
    "ChunkAsk",
    "ChunkData",
    "SliceAsk",
    "SliceOffer",
    "SliceRefusal",
    "TransferMessage",
]

#: Largest header frame on a weights ROUTER (a refusal's message is the longest part).
MAX_TRANSFER_HEADER = 64 * 1024


class SliceAsk(msgspec.Struct, tag=True, kw_only=True):
    """Prepare the slice ``[start, end)`` of the model whose file has ``sha256`` (hex,
    else the ask does not decode). The holder answers :class:`SliceOffer` once the slice
    is cut and hashed (seconds for a big model: the asker waits), or :class:`SliceRefusal`.
    ``model`` is the name the holder advertises the file under; ``version`` the slicing
    format the asker reads."""

    model: str
    sha256: Sha256
    start: int
    end: int
    version: int


class SliceOffer(msgspec.Struct, tag=True, kw_only=True):
    """A prepared slice: ``slice`` is its content id, ``size`` its bytes, cut in chunks
    of ``chunk`` bytes whose sha256 digests (32 bytes each, in order) travel in the
    second frame."""

    slice: str
    size: int
    chunk: int


class ChunkAsk(msgspec.Struct, tag=True, kw_only=True):
    """Send chunk ``index`` of a slice offered before (one credit of the window)."""

    slice: str
    index: int


class ChunkData(msgspec.Struct, tag=True, kw_only=True):
    """Chunk ``index`` of ``slice``; its bytes are the second frame."""

    slice: str
    index: int


class SliceRefusal(msgspec.Struct, tag=True, kw_only=True):
    """No: ``code`` is ``not_held`` (no such file here), ``bad_range``, ``version``,
    ``unknown_slice`` (not prepared, or evicted: ask again) or ``failed``."""

    slice: str
    code: str
    message: str


TransferMessage = SliceAsk | SliceOffer | ChunkAsk | ChunkData | SliceRefusal
