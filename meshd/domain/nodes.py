"""What a node offers to compute with: its GPUs, and itself as placement sees it."""

from __future__ import annotations

import msgspec

__all__ = ["Device", "NodeResources"]


class Device(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A GPU an engine backend of a node computes on (``meshd.engines.probe``).

    ``mem_free`` is the device's free memory: as probed in a card; in placement's
    input (``NodeResources.devices``), less what the stages of other instances placed
    on the node take of it. ``unified`` devices (Apple silicon, integrated GPUs) use
    the host's memory, which ``mem_available`` already counts: placement budgets them
    as RAM."""

    #: The backend that uses it, e.g. ``llama_cpp-cuda``, ``mlx-metal``.
    backend: str
    #: The engine's own name for it, e.g. ``CUDA0``, ``Vulkan0``, ``Metal``.
    name: str
    description: str = ""
    mem_total: int = 0
    mem_free: int = 0
    unified: bool = False


class NodeResources(msgspec.Struct, frozen=True):
    """One live node as placement sees it.

    ``backends`` are engine backends such as ``llama_cpp-cpu`` or ``mlx-metal``
    (``<engine>-<device>``). ``mem_available`` and ``mem_total`` are bytes.
    ``decode_bps`` is the node's measured decode speed (bytes of weights read per
    second); 0 means not measured. ``rtt_ms`` its round trips to peers, by id, and
    ``bw_mbps`` the bandwidth of its links to them (Mbit/s; a peer absent: unknown).
    ``holds`` lists the instances this node has a runner loading or ready for: the
    memory those runners hold is no longer in ``mem_available``, and a repair credits
    it back (see ``Policy.credit_held``).
    """

    id: str
    name: str
    backends: list[str]
    mem_available: int
    mem_total: int = 0
    decode_bps: float = 0.0
    holds: list[str] = []
    rtt_ms: dict[str, float] = {}
    #: Its GPUs, ``mem_free`` less what other instances' stages on it take there.
    devices: list[Device] = []
    bw_mbps: dict[str, float] = {}
