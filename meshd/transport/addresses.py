"""This host's addresses, and which of a peer's addresses to dial.

``choose_address`` is pure: give it two lists of strings and it answers, so the rule
can be pinned with literals. ``local_addresses`` and ``virtual_addresses`` are the
helpers here that read the machine (through ``ifaddr``).

Why virtual interfaces matter: a container bridge (``docker0`` = 172.17.0.1), a libvirt
bridge (``virbr0`` = 192.168.122.1) and the like carry the *same* address on every host
that runs that software. Such an address proves nothing about which host a peer is on;
taking it as proof made two Docker hosts each dial 127.0.0.1, that is, themselves.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection

import ifaddr

LOOPBACK = "127.0.0.1"

#: Interface name prefixes of bridges and virtual links whose addresses are the same on
#: many hosts (container runtimes, hypervisors, overlay networks, macOS sharing).
VIRTUAL_PREFIXES = (
    "docker", "br-", "virbr", "veth", "cni", "flannel", "cali", "cilium", "vxlan",
    "weave", "lxcbr", "lxdbr", "podman", "kube-", "vmnet", "vboxnet", "bridge", "nerdctl",
)  # fmt: skip


def is_virtual_interface(name: str) -> bool:
    """True for a bridge or virtual link whose address many hosts may share."""
    return name.lower().startswith(VIRTUAL_PREFIXES)


def _parse(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return None


def _is_loopback(addr: str) -> bool:
    ip = _parse(addr)
    return ip is not None and ip.is_loopback


def _is_link_local(addr: str) -> bool:
    ip = _parse(addr)
    return ip is not None and ip.is_link_local


def _subnet_key(addr: str) -> tuple[int, int] | None:
    """The /24 (IPv4) or /64 (IPv6) network of an address, as a comparable key."""
    ip = _parse(addr)
    if ip is None:
        return None
    bits = 24 if ip.version == 4 else 64
    net = ipaddress.ip_network(f"{ip}/{bits}", strict=False)
    return (ip.version, int(net.network_address))


def local_addresses() -> list[str]:
    """This host's IPv4 addresses: non-loopback first, loopback last.

    Order among non-loopback addresses follows the adapter order ``ifaddr`` reports.
    ``127.0.0.1`` is always present (last), even if no adapter lists it.
    """
    routable: list[str] = []
    loopback: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if not ip.is_IPv4:
                continue
            addr = str(ip.ip)
            bucket = loopback if _is_loopback(addr) else routable
            if addr not in bucket:
                bucket.append(addr)
    if LOOPBACK in loopback:
        loopback.remove(LOOPBACK)
    return [*routable, *loopback, LOOPBACK]


def virtual_addresses() -> set[str]:
    """This host's IPv4 addresses on bridges and virtual links (see
    :func:`is_virtual_interface`): they must not prove that a peer is on this host."""
    out: set[str] = set()
    for adapter in ifaddr.get_adapters():
        if is_virtual_interface(str(adapter.name)) or is_virtual_interface(adapter.nice_name):
            out.update(str(ip.ip) for ip in adapter.ips if ip.is_IPv4)
    return out


def interface_addresses() -> list[tuple[str, str, int]]:
    """``(interface name, IPv4 address, prefix length)`` of every address of this host
    (``meshctl doctor`` says which interface an address it dials is on)."""
    return [
        (str(adapter.nice_name or adapter.name), str(ip.ip), int(ip.network_prefix))
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if ip.is_IPv4
    ]


def choose_address(
    own: list[str],
    peer: list[str],
    *,
    ambiguous: Collection[str] = (),
    exclude: Collection[str] = (),
) -> str:
    """Pick which of a peer's advertised addresses to dial. Pure.

    ``ambiguous``: our addresses that other hosts may carry too (bridges, see
    :func:`virtual_addresses`); they never prove the peer is on this host.
    ``exclude``: addresses already found to reach something else (this node itself);
    never chosen again, loopback included, unless nothing else is left.

    Rules, first match wins (ties keep the peer's order):

    1. Same host: if any non-loopback, non-link-local address of the peer is also one
       of ``own`` (not counting ``ambiguous`` ones), the peer runs on this machine;
       return ``"127.0.0.1"``.
    Otherwise a peer address that is also one of ours is skipped (it reaches us).

    2. Same subnet: the first peer address that shares a subnet with one of our
       non-loopback addresses (same first three octets, i.e. the /24, for IPv4;
       the /64 for IPv6), skipping loopback and link-local addresses.
    3. The first peer address that is neither loopback nor link-local.
    4. The first peer address that is not loopback.
    5. The first peer address (e.g. a peer that only advertises loopback).

    Raises ``ValueError`` if ``peer`` is empty.
    """
    if not peer:
        raise ValueError("peer advertises no address")
    if exclude:
        left = [a for a in peer if a not in exclude]
        peer = left or peer  # every address excluded: keep trying rather than give up
    own_set = {a for a in own if not _is_loopback(a)}
    proof = own_set.difference(ambiguous)
    same_host = any(a in proof for a in peer if not _is_loopback(a) and not _is_link_local(a))
    if same_host and LOOPBACK not in exclude:
        return LOOPBACK
    if not same_host:
        # Another host that shares one of our (bridge) addresses: that address reaches
        # us, not it.
        peer = [a for a in peer if a not in own_set] or peer

    usable = [a for a in peer if not _is_loopback(a) and not _is_link_local(a)]
    own_nets = {_subnet_key(a) for a in own_set if not _is_link_local(a)}
    own_nets.discard(None)
    for addr in usable:
        if _subnet_key(addr) in own_nets:
            return addr
    if usable:
        return usable[0]
    for addr in peer:
        if not _is_loopback(addr):
            return addr
    return peer[0]
