"""This host's addresses, and which of a peer's addresses to dial.

``choose_address`` is pure: give it two lists of strings and it answers, so the rule
can be pinned with literals. ``local_addresses`` is the one helper here that reads
the machine (through ``ifaddr``).
"""

from __future__ import annotations

import ipaddress

import ifaddr

LOOPBACK = "127.0.0.1"


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


def choose_address(own: list[str], peer: list[str]) -> str:
    """Pick which of a peer's advertised addresses to dial. Pure.

    Rules, first match wins (ties keep the peer's order):

    1. Same host: if any non-loopback address of the peer is also one of ``own``,
       the peer runs on this machine; return ``"127.0.0.1"``.
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
    own_set = {a for a in own if not _is_loopback(a)}
    if any(a in own_set for a in peer if not _is_loopback(a)):
        return LOOPBACK

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
