"""What is wrong with this node and its cluster, and what to do about it (``meshctl
doctor``, ``GET /v1/doctor``).

:func:`diagnose` is pure: it turns a :class:`Snapshot` (facts the node observed:
its cluster view, what Bonjour showed it, the joins and handshakes it refused, how
each peer's ports answered a probe, ...) into :class:`Finding` s, each one line of
what is wrong and one line of what to do, and the list of what it examined. The facts
are gathered at the edge (``NodeServices.doctor``, ``meshd.node.probes``); build a
snapshot from literals to try a rule.
"""

from __future__ import annotations

from meshd.transport.addresses import is_virtual_interface

from .cluster import CRASH_LOOP, MODEL_MISSING, ClusterView
from .dependencies import FIX
from .diagnosis_facts import (
    Checked,
    Finding,
    Interface,
    PortCheck,
    Refusal,
    Report,
    Severity,
    Sighting,
    Snapshot,
    TwinSeen,
    Waiting,
)

__all__ = [
    "BONJOUR_SETTLE_S",
    "DISK_ERROR_BYTES",
    "DISK_WARN_BYTES",
    "VPN_PREFIXES",
    "Checked",
    "Finding",
    "Interface",
    "PortCheck",
    "Refusal",
    "Report",
    "Severity",
    "Sighting",
    "Snapshot",
    "TwinSeen",
    "Waiting",
    "diagnose",
    "interface_kind",
]

_RANK = {"error": 0, "warning": 1, "info": 2}

#: Interface name prefixes of VPN and overlay links: their addresses are real, but
#: multicast rarely crosses them and a LAN peer cannot dial them.
VPN_PREFIXES = ("tun", "tap", "wg", "tailscale", "utun", "zt", "ppp", "ipsec", "nordlynx")
#: Bonjour needs a few seconds to hear its peers: "found nobody" is not judged earlier.
BONJOUR_SETTLE_S = 10.0
#: A peer seen on Bonjour this long ago without a card here is worth a word.
UNSEEN_CARD_S = 10.0
#: Free disk under the slice cache below which cutting a slice fails (error), or may
#: fail for a model of a few GiB (warning).
DISK_ERROR_BYTES = 256 << 20
DISK_WARN_BYTES = 2 << 30
#: A non-member keeps redialling (libzmq reconnects every half second), so a ZAP denial
#: older than this was a race at admission (a new member's entry not here yet), not a
#: stranger; a join refusal older than this is history (info), not a current error.
ZAP_RECENT_S = 60.0
REFUSAL_RECENT_S = 600.0
#: A peer's heartbeat stamped this far ahead of our clock is worth a warning (or half
#: the drift bound, if that is smaller); at the bound its entries are refused.
CLOCK_WARN_MS = 10_000


def interface_kind(name: str) -> str | None:
    """``bridge`` for a bridge or virtual link many hosts share, ``vpn`` for a VPN or
    overlay link, None for an ordinary interface."""
    if is_virtual_interface(name):
        return "bridge"
    if name.lower().startswith(VPN_PREFIXES):
        return "vpn"
    return None


def _ago(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    if word.endswith("y"):
        return f"{n} {word[:-1]}ies"
    return f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def _in_subnet(addr: str, iface: Interface) -> bool:
    import ipaddress

    try:
        net = ipaddress.ip_network(f"{iface.address}/{iface.prefix}", strict=False)
        return ipaddress.ip_address(addr) in net
    except ValueError:
        return False


def _peers(v: ClusterView) -> list[str]:
    """The other nodes with a card (members only, in a secured cluster), by name."""
    ids = [n for n in v.cards if n != v.self_id and (not v.members or n in v.members)]
    return sorted(ids, key=lambda n: (v.cards[n].name, n))


class _Out:
    """Findings and checks as they are made."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.checked: list[Checked] = []

    def add(self, severity: Severity, code: str, what: str, fix: str) -> None:
        self.findings.append(Finding(severity=severity, code=code, what=what, fix=fix))

    def check(self, name: str, detail: str) -> None:
        self.checked.append(Checked(name=name, detail=detail))


# -- the rules -------------------------------------------------------------------------


def diagnose(s: Snapshot) -> Report:
    """Every finding the snapshot supports, errors first, and what was examined."""
    out = _Out()
    _bonjour(s, out)
    _doors(s, out)
    _liveness_and_ports(s, out)
    _twins(s, out)
    _clock(s, out)
    _versions(s, out)
    _dependencies(s, out)
    _interfaces(s, out)
    _instances(s, out)
    _disk(s, out)
    findings = sorted(out.findings, key=lambda f: _RANK[f.severity])
    return Report(node=s.view.self_id, name=s.name, findings=findings, checked=out.checked)


def _bonjour(s: Snapshot, out: _Out) -> None:
    if s.discovery == "off":
        out.check("bonjour", "off (--no-discovery): peers come from --peer seeds only")
        return
    if s.discovery == "failed":
        out.check("bonjour", "could not start")
        out.add(
            "warning",
            "bonjour_unavailable",
            "Bonjour (mDNS) could not start on this node: it finds no peer by itself",
            "give it a seed: meshd up --peer HOST:7471 (any member's address)",
        )
        return
    present = [x for x in s.sightings if x.present]
    foreign = [x for x in present if not x.same_cluster]
    out.check(
        "bonjour",
        f"on for {s.discovery_s:.0f} s: {_plural(len(present), 'meshd advert')} seen "
        f"({len(foreign)} of another cluster), {_plural(len(s.bonjour_peers), 'peer')} "
        "of this cluster",
    )
    for x in foreign:
        where = f"{x.host}:{x.port}"
        if x.cluster_name and x.cluster_name == s.cluster:
            what = (
                f"node {x.name!r} ({x.node_id}) at {where} advertises a cluster named "
                f"{x.cluster_name!r} too, but with another key: two clusters were "
                "started apart"
            )
            fix = (
                "if it belongs here: stop it, delete cluster.key and cluster.json in its "
                "data dir, start it with no flags and run `meshctl approve CODE` here "
                "(CODE: what its meshd shows; or give every node the same --secret-file)"
            )
        else:
            theirs = f"cluster {x.cluster_name!r}" if x.cluster_name else "another cluster"
            what = (
                f"node {x.name!r} ({x.node_id}) at {where} is in {theirs}, not in "
                f"{s.cluster!r}: this node ignores it"
            )
            fix = (
                f"if it belongs here: start it with --cluster {s.cluster} and this "
                "cluster's --secret-file (or with no flags, then `meshctl approve CODE` "
                "here, CODE being what its meshd shows)"
            )
        out.add("warning", "other_cluster", what, fix)
    for x in present:
        if x.version and x.version != s.version and x.node_id not in s.view.cards:
            out.add(
                "warning",
                "other_version",
                f"node {x.name!r} ({x.node_id}) at {x.host}:{x.port} runs meshd "
                f"{x.version} (this node: {s.version}) and is not in this node's view",
                "run the same meshd version on every node",
            )
    for x in present:
        if x.same_cluster and x.node_id not in s.view.cards and x.age_s >= UNSEEN_CARD_S:
            out.add(
                "warning",
                "not_in_view",
                f"node {x.name!r} ({x.node_id}) advertises this cluster at "
                f"{x.host}:{x.port} (seen {_ago(x.age_s)}) but never got into this "
                "node's view",
                f"check that its mesh port {x.port} answers from here (a firewall?) "
                "and that it is a member (meshctl members)",
            )
    if s.malformed_adverts:
        out.add(
            "info",
            "bonjour_malformed",
            f"{_plural(s.malformed_adverts, 'Bonjour advert')} of _meshd._tcp could not "
            "be read (a much older or newer meshd?)",
            "run the same meshd version on every node",
        )
    live = [n for n in _peers(s.view) if s.view.is_live(n)]
    if live and not s.sightings and s.discovery_s >= BONJOUR_SETTLE_S:
        via = f" through --peer {', '.join(s.seeds)}" if s.seeds else " through seeds"
        out.add(
            "warning",
            "no_multicast",
            f"Bonjour found no meshd node in {s.discovery_s:.0f} s although "
            f"{_plural(len(live), 'peer')} answer{'s' if len(live) == 1 else ''}{via}: "
            "multicast does not pass between these hosts",
            "keep a --peer seed on every node, or let mDNS through (UDP 5353 to "
            "224.0.0.251; Wi-Fi client isolation and VPNs block it)",
        )


_JOIN_REFUSALS: dict[str, tuple[Severity, str, str]] = {
    "bad_proof": (
        "error",
        "carried another cluster's secret",
        "give it this cluster's secret file (--secret-file), or start it without "
        "one and approve it here: meshctl approve CODE (what its meshd shows)",
    ),
    "wrong_code": (
        "warning",
        "gave a wrong pairing code",
        "make a new code with `meshctl invite` and start it with `meshd up --join CODE`",
    ),
    "unknown_invite": (
        "warning",
        "gave a pairing code this node does not know (used, burned or expired)",
        "make a new code here with `meshctl invite`",
    ),
    "zap_denied": (
        "error",
        "passed the CURVE handshake with a key that is no member's (a "
        "removed member, or a node the cluster never admitted)",
        "if it should be in, start it with this cluster's --secret-file or "
        "approve it; if it was removed, stop it",
    ),
    "busy": (
        "warning",
        "sent join requests faster than the desk takes them",
        "look at what runs there: one meshd asks once a second",
    ),
}


def _doors(s: Snapshot, out: _Out) -> None:
    if not s.secured:
        out.check("join desk", "open cluster (--open): no keys, anyone on the LAN joins")
        return
    out.check(
        "join desk",
        f"{_plural(len(s.refusals), 'refusal')} recorded, "
        f"{_plural(len(s.waiting), 'node')} waiting for approval",
    )
    for r in sorted(s.refusals, key=lambda r: r.age_s):
        if r.reason == "zap_denied" and r.age_s > ZAP_RECENT_S:
            continue
        sev, why, fix = _JOIN_REFUSALS.get(
            r.reason, ("info", f"was refused ({r.reason})", "look at that node's log")
        )
        if r.age_s > REFUSAL_RECENT_S:
            sev = "info"
        who = f"node {r.name!r} ({r.node_id}) at {r.address}" if r.name else r.address
        if not r.name and r.node_id:
            who = f"node {r.node_id} at {r.address}"
        code = "zap_refused" if r.reason == "zap_denied" else "join_refused"
        out.add(
            sev,
            code,
            f"{who} was refused {_plural(r.count, 'time')} (last {_ago(r.age_s)}): it {why}",
            fix.replace("NAME", r.name or "NAME"),
        )
    for w in s.waiting:
        at = f" at {w.address}" if w.address else ""
        out.add(
            "warning",
            "waiting_approval",
            f"node {w.name!r} ({w.node_id}){at} has waited {w.waiting_s:.0f} s for a "
            "member to approve it",
            "meshctl approve CODE, CODE being what its meshd shows (or use --secret-file)",
        )
    failed = {k: v for k, v in s.handshake_failures.items() if v}
    out.check(
        "handshakes",
        "no failed CURVE handshake"
        if not failed
        else ", ".join(f"{v} on {k}" for k, v in sorted(failed.items())),
    )
    if failed:
        total = sum(failed.values())
        out.add(
            "warning",
            "handshake_failed",
            f"{_plural(total, 'connection')} to this node's "
            f"{', '.join(sorted(failed))} port{'s' if len(failed) > 1 else ''} failed the "
            "CURVE handshake: a peer with no cluster secret or another one (libzmq does "
            "not say which)",
            "start every node with the same --secret-file, or join it by approval; an "
            "--open node cannot talk to a secured cluster",
        )


_OUTCOME = {
    "no_answer": "do not answer",
    "handshake_failed": "answer, but the handshake fails",
}


def _liveness_and_ports(s: Snapshot, out: _Out) -> None:
    v = s.view
    peers = _peers(v)
    states: dict[str, int] = {}
    for n in peers:
        state = v.liveness.get(n, "unknown")
        states[state] = states.get(state, 0) + 1
    out.check(
        "liveness",
        f"{_plural(len(peers), 'peer')}"
        + (": " + ", ".join(f"{k} {c}" for k, c in sorted(states.items())) if peers else ""),
    )
    by_node: dict[str, list[PortCheck]] = {}
    for p in s.ports:
        by_node.setdefault(p.node, []).append(p)
    bad_total = sum(1 for p in s.ports if p.outcome != "ok")
    out.check(
        "ports",
        f"{_plural(len(s.ports), 'port')} of {_plural(len(by_node), 'peer')} probed "
        f"({s.probe_timeout_s:g} s each): {len(s.ports) - bad_total} answer",
    )
    for n in peers:
        st = v.liveness.get(n)
        card = v.cards[n]
        bad = [p for p in by_node.get(n, []) if p.outcome != "ok"]
        who = f"node {card.name!r} ({n})"
        closed = ""
        if bad:
            host = bad[0].host
            groups: dict[str, list[str]] = {}
            for p in bad:
                groups.setdefault(p.outcome, []).append(f"{p.port_name} {p.port}")
            closed = "; ".join(
                f"its {', '.join(ps)} {_OUTCOME.get(o, o)} from here ({host})"
                for o, ps in groups.items()
            )
        if st in ("dead", None):
            silent = v.ages.get(n)
            since = (
                "no heartbeat ever arrived"
                if silent is None
                else (f"no heartbeat for {silent:.0f} s")
            )
            out.add(
                "warning",
                "peer_dead",
                f"{who} is {st or 'not heard from'}: {since}" + (f"; {closed}" if closed else ""),
                "is meshd running there? If its PUB port is blocked, open it; a node "
                "silent for --forget-after (10 min) is forgotten",
            )
        elif bad:
            ports = ", ".join(str(p.port) for p in bad)
            out.add(
                "error",
                "ports_closed",
                f"{who} is {st} but {closed}",
                f"open TCP port{'s' if len(bad) > 1 else ''} {ports} on {card.name} (its "
                "firewall: nft/iptables/ufw) or start it with --advertise an address "
                "this node can reach",
            )


def _twins(s: Snapshot, out: _Out) -> None:
    out.check(
        "node id",
        f"{_plural(len(s.twins), 'other process')} seen with this id; "
        f"{s.own_id_refused} entries under it refused",
    )
    for t in s.twins:
        if not t.confirmed:  # a claim: a replay, a forgery, or a copy not yet challenged
            out.add("warning", "unproven_twin", f"{t.name!r} at {t.address} claimed this "
                    f"node's id ({_ago(t.age_s)}) but signed no fresh challenge with its key",
                    "nothing to do unless a copy of this data dir runs there")  # fmt: skip
            continue
        out.add(
            "error",
            "duplicate_id",
            f"another meshd process ({t.name!r} at {t.address}) signed a challenge with "
            f"this node's key ({_ago(t.age_s)}): two processes share id {s.view.self_id}",
            "on that machine, delete identity.json and node.key from its data dir "
            "(a cloned VM also needs its own /etc/machine-id), then start it again",
        )
    if s.own_id_refused and not s.twins:
        out.add(
            "warning",
            "own_id_refused",
            f"{_plural(s.own_id_refused, 'entry')} under this node's id came from "
            "elsewhere: a copy of its identity runs somewhere, or a forgery",
            "look for 'another live meshd process' in the nodes' logs; a clone needs its "
            "own identity (delete identity.json and node.key there)",
        )


def _clock(s: Snapshot, out: _Out) -> None:
    bound = s.max_drift_ms
    ahead = {n: ms for n, ms in s.clock_ahead_ms.items() if n != s.view.self_id}
    worst = max(ahead.items(), key=lambda kv: kv[1], default=None)
    out.check(
        "clock",
        f"heartbeats of {_plural(len(ahead), 'peer')}"
        + (f": at most {max(worst[1], 0) / 1000:.1f} s ahead" if worst else "")
        + f"; {s.clock_drift_refused} entries refused (bound {bound / 1000:g} s)",
    )
    fix = (
        "turn on time sync on every node (timedatectl set-ntp true; macOS: Date & Time "
        "> set automatically)"
    )
    culprit = ""
    if worst is not None:
        card = s.view.cards.get(worst[0])
        culprit = f"node {card.name if card else worst[0]!r} ({worst[0]})"
    if s.clock_drift_refused:
        who = (
            f"; {culprit}'s stamps run {worst[1] / 1000:.0f} s ahead"
            if (worst and worst[1] >= 1000)
            else ""
        )
        out.add(
            "error",
            "clock_drift",
            f"{_plural(s.clock_drift_refused, 'entry')} refused for a clock more than "
            f"{bound / 1000:g} s ahead of this node's clock{who}",
            f"{fix} (or raise --max-clock-drift)",
        )
    elif worst is not None and worst[1] >= bound:
        out.add(
            "error",
            "clock_drift",
            f"{culprit} stamps its heartbeats {worst[1] / 1000:.0f} s ahead of this "
            f"node's clock: over the {bound / 1000:g} s bound",
            fix,
        )
    elif worst is not None and worst[1] >= min(CLOCK_WARN_MS, bound // 2):
        out.add(
            "warning",
            "clock_skew",
            f"{culprit} (or a node whose stamps it relays) runs {worst[1] / 1000:.0f} s "
            f"ahead of this node's clock (entries over {bound / 1000:g} s are refused)",
            fix,
        )


def _versions(s: Snapshot, out: _Out) -> None:
    other = [n for n in _peers(s.view) if s.view.cards[n].version != s.version]
    out.check(
        "versions",
        f"this node runs {s.version}"
        + (f"; {len(other)} peer(s) another" if other else "; every peer the same"),
    )
    for n in other:
        c = s.view.cards[n]
        out.add(
            "warning",
            "other_version",
            f"node {c.name!r} ({n}) runs meshd {c.version or '?'} (this node: {s.version})",
            "run the same meshd version on every node",
        )


def _dependencies(s: Snapshot, out: _Out) -> None:
    out.check(
        "dependencies",
        f"{len(s.untested)} package(s) outside the tested range" if s.untested
        else "the engines and msgspec are versions meshd was tested with",
    )  # fmt: skip
    for u in s.untested:
        out.add("warning", "untested_dependency", u.line(), FIX)


def _interfaces(s: Snapshot, out: _Out) -> None:
    by_addr = {i.address: i for i in s.interfaces}
    shown = [a for a in s.advertised if not a.startswith("127.")]
    out.check(
        "interfaces",
        "advertised "
        + (
            ", ".join(f"{a} ({by_addr[a].name})" if a in by_addr else a for a in shown)
            or "loopback only"
        ),
    )
    odd = [(a, by_addr[a]) for a in shown if a in by_addr and interface_kind(by_addr[a].name)]
    if shown and len(odd) == len(shown):
        names = ", ".join(f"{a} on {i.name}" for a, i in odd)
        out.add(
            "warning",
            "virtual_address",
            f"this node advertises only addresses on bridge/VPN interfaces ({names}): "
            "peers on the LAN cannot dial it there",
            "start it with --advertise ITS_LAN_ADDRESS (or --mesh-host)",
        )
    odd_ifaces = [i for i in s.interfaces if interface_kind(i.name)]
    for nid, host in sorted(s.dialled.items()):
        if nid == s.view.self_id or host.startswith("127."):
            continue
        iface = next((i for i in odd_ifaces if _in_subnet(host, i)), None)
        if iface is None:
            continue
        card = s.view.cards.get(nid)
        who = f"node {card.name!r} ({nid})" if card else f"node {nid}"
        if interface_kind(iface.name) == "bridge":
            out.add(
                "warning",
                "bridge_address",
                f"{who} is dialled at {host}, on this host's {iface.name} bridge: "
                "another host's container or VM bridge may answer there, not it",
                f"start {card.name if card else 'it'} with --advertise ITS_LAN_ADDRESS",
            )
        else:
            out.add(
                "info",
                "vpn_address",
                f"{who} is dialled at {host}, over {iface.name} (a VPN or overlay)",
                "fine if the VPN is the way between these hosts; else start it with "
                "--advertise ITS_LAN_ADDRESS",
            )


def _instances(s: Snapshot, out: _Out) -> None:
    v = s.view
    insts = sorted(v.instances.values(), key=lambda i: i.id)
    ready = {i.id for i in insts if v.is_ready(i)}
    out.check("instances", f"{_plural(len(insts), 'instance')}, {len(ready)} ready")
    for inst in insts:
        name = f"instance {inst.id} ({inst.spec.model})"
        for nid, r in v.gave_up_on(inst).items():
            who = v.cards[nid].name if nid in v.cards else nid
            if r.reason.startswith(CRASH_LOOP):
                fix = (
                    f"read {who}'s log for the runner's error; restarting meshd on {who} "
                    "lets it try again"
                )
            elif r.reason.startswith(MODEL_MISSING):
                fix = (
                    f"put the model where {who} loads from (--models DIR, the HF cache) and "
                    f"restart meshd on {who}"
                )
            else:
                fix = (
                    f"{who} lacks memory or runner slots for it: give it more "
                    "(--max-memory) or remove other instances (meshctl rm ID)"
                )
            out.add(
                "warning",
                "runner_given_up",
                f"node {who!r} gave up its stage {r.stage} of {name}: {r.reason}",
                fix,
            )
        why = v.unrepairable(inst)
        if why is not None:
            out.add(
                "error",
                "unrepairable",
                f"{name} cannot serve: {why}",
                "add a node that holds the model and has the memory, free memory on the "
                f"nodes, or remove it (meshctl rm {inst.id}) and place a smaller model",
            )
            continue
        if inst.id in ready:
            continue
        for i, st in enumerate(v.stage_states(inst)):
            who = v.cards[st.node].name if st.node in v.cards else st.node
            if st.state in ("failed", "unavailable") and st.node not in v.gave_up_on(inst):
                out.add(
                    "warning",
                    "stage_down",
                    f"{name} does not serve: stage {i} on {who!r} is {st.state}"
                    + (f" ({st.reason})" if st.reason else ""),
                    f"read {who}'s log; the stage moves by itself when a repair is possible",
                )
            elif st.state in ("loading", "pending"):
                out.add(
                    "info",
                    "stage_loading",
                    f"{name}: stage {i} on {who!r} is {st.state}",
                    "wait: a model loads in seconds to minutes",
                )
            elif st.state == "fetching":
                done = f"{st.fetched / 1e6:.0f} of {st.fetch_total / 1e6:.0f} MB"
                out.add(
                    "info",
                    "stage_fetching",
                    f"{name}: stage {i} on {who!r} is fetching its weights ({done})",
                    "wait: it fetches only its layers from the nodes that hold the model",
                )


def _disk(s: Snapshot, out: _Out) -> None:
    if s.disk_free is None:
        out.check("disk", f"{s.disk_path or 'slice cache'}: free space unknown")
        return
    out.check("disk", f"{s.disk_path}: {_gib(s.disk_free)} free")
    if s.disk_free < DISK_WARN_BYTES:
        sev: Severity = "error" if s.disk_free < DISK_ERROR_BYTES else "warning"
        out.add(
            sev,
            "disk_low",
            f"only {_gib(s.disk_free)} free under {s.disk_path}, where model slices are "
            "cut: a stage of a bigger model cannot load here",
            "free disk on that volume (a smaller --slice-cache keeps fewer unused slices)",
        )
