"""choose_address with bridges and self-reaching addresses: pure, pinned with literals."""

from __future__ import annotations

import pytest

from meshd.transport.addresses import choose_address, is_virtual_interface


def test_two_docker_hosts_do_not_dial_themselves() -> None:
    """Both hosts carry docker0 = 172.17.0.1. Was: 'same host', so each dialled
    127.0.0.1, that is, itself."""
    own = ["192.168.1.5", "172.17.0.1", "127.0.0.1"]
    peer = ["192.168.1.9", "172.17.0.1", "127.0.0.1"]
    assert choose_address(own, peer, ambiguous={"172.17.0.1"}) == "192.168.1.9"


def test_a_shared_bridge_address_is_never_dialled_even_when_listed_first() -> None:
    own = ["172.17.0.1", "10.0.0.5"]
    peer = ["172.17.0.1", "10.0.0.9"]
    assert choose_address(own, peer, ambiguous={"172.17.0.1"}) == "10.0.0.9"


def test_a_real_shared_address_still_means_same_host() -> None:
    own = ["192.168.1.5", "172.17.0.1"]
    peer = ["192.168.1.5", "172.17.0.1"]
    assert choose_address(own, peer, ambiguous={"172.17.0.1"}) == "127.0.0.1"


def test_shared_link_local_addresses_prove_nothing() -> None:
    assert choose_address(["169.254.1.1", "10.0.0.5"], ["169.254.1.1", "10.0.0.9"]) == "10.0.0.9"


def test_a_container_still_reaches_its_host_over_the_bridge() -> None:
    # The container's own eth0 is not a bridge; the host's docker0 shares its subnet.
    assert choose_address(["172.17.0.2"], ["192.168.1.5", "172.17.0.1"]) == "172.17.0.1"


def test_an_address_that_reached_this_node_is_excluded() -> None:
    # Loopback answered with our own id: try the peer's advertised addresses instead.
    own = ["192.168.1.5"]
    peer = ["192.168.1.5", "10.8.0.2"]
    assert choose_address(own, peer) == "127.0.0.1"
    assert choose_address(own, peer, exclude={"127.0.0.1"}) == "192.168.1.5"
    assert choose_address(["10.0.0.1"], ["10.0.0.7", "10.0.0.8"], exclude={"10.0.0.7"}) == (
        "10.0.0.8"
    )
    # Everything excluded: keep trying the best guess rather than give up.
    assert choose_address(["10.0.0.1"], ["10.0.0.7"], exclude={"10.0.0.7"}) == "10.0.0.7"


@pytest.mark.parametrize(
    ("name", "virtual"),
    [
        ("docker0", True), ("br-1a2b3c", True), ("virbr0", True), ("veth12ab", True),
        ("cni0", True), ("flannel.1", True), ("bridge100", True), ("vboxnet0", True),
        ("eth0", False), ("en0", False), ("wlan0", False), ("enp3s0", False),
        ("tailscale0", False), ("lo", False),
    ],
)  # fmt: skip
def test_bridge_and_virtual_interfaces_are_recognised(name: str, virtual: bool) -> None:
    assert is_virtual_interface(name) is virtual
