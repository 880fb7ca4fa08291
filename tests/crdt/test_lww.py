"""LWW-map: the CRDT laws, convergence under anti-entropy, digests, tombstones and GC."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from meshd.crdt import HLC, N_BUCKETS, Entry, LWWMap, stable_horizon
from meshd.crdt.lww import bucket_of, entry_hash

# A few keys and writers and a narrow clock range, so that conflicts and exact ties on
# the clock are common rather than rare.
KEYS = ["node/n1", "health/n1", "instance/a", "instance/b", "k", "x", "y", "z"]
WRITERS = ["n1", "n2", "n3", "n4"]

keys = st.sampled_from(KEYS)
writers = st.sampled_from(WRITERS)
values = st.one_of(st.none(), st.binary(max_size=4))
entries = st.builds(Entry, key=keys, hlc=st.integers(0, 40), writer=writers, value=values)
entry_lists = st.lists(entries, max_size=30)
states = entry_lists.map(LWWMap)


def join(a: LWWMap, b: LWWMap) -> LWWMap:
    """The replica ``a`` becomes after merging everything ``b`` holds (``a`` untouched)."""
    m = a.copy()
    m.merge_many(b.entries())
    return m


def assert_same(a: LWWMap, b: LWWMap) -> None:
    assert a.same_state(b)
    assert a.digest() == b.digest()
    assert a.root() == b.root()


def anti_entropy(a: LWWMap, b: LWWMap) -> None:
    """One exchange as a node does it: A sends its digest, B answers with what differs,
    A merges; then the same the other way round."""
    a.merge_many(b.diff(a.digest()))
    b.merge_many(a.diff(b.digest()))


def ring_sync(replicas: list[LWWMap]) -> None:
    """Two passes of anti-entropy around a ring: enough for every replica to hold all."""
    n = len(replicas)
    for _ in range(2):
        for i in range(n):
            anti_entropy(replicas[i], replicas[(i + 1) % n])


# -- the laws -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(a=states, b=states)
def test_merge_is_commutative(a: LWWMap, b: LWWMap) -> None:
    assert_same(join(a, b), join(b, a))


@settings(max_examples=200, deadline=None)
@given(a=states, b=states, c=states)
def test_merge_is_associative(a: LWWMap, b: LWWMap, c: LWWMap) -> None:
    assert_same(join(join(a, b), c), join(a, join(b, c)))


@settings(max_examples=200, deadline=None)
@given(a=states, b=states)
def test_merge_is_idempotent(a: LWWMap, b: LWWMap) -> None:
    assert_same(join(a, a), a)
    assert a.copy().merge_many(a.entries()) == []
    ab = join(a, b)
    assert_same(join(ab, b), ab)
    assert_same(join(ab, a), ab)


@settings(max_examples=200, deadline=None)
@given(log=entry_lists, data=st.data())
def test_delivery_order_and_duplicates_do_not_change_the_result(
    log: list[Entry], data: st.DataObject
) -> None:
    reference = LWWMap(log)
    dupes = data.draw(st.lists(st.sampled_from(log), max_size=10)) if log else []
    shuffled = data.draw(st.permutations(log + dupes))
    assert_same(LWWMap(shuffled), reference)


@settings(max_examples=200, deadline=None)
@given(log=entry_lists)
def test_merge_keeps_the_largest_entry_per_key(log: list[Entry]) -> None:
    m = LWWMap(log)
    for key in {e.key for e in log}:
        assert m.get(key) == max((e for e in log if e.key == key), key=Entry.order)
    assert len(m) == len({e.key for e in log})


# -- convergence ----------------------------------------------------------------------


class FakeWall:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


@dataclass
class Writer:
    """A replica with its own clock, whose wall clock is skewed from simulated time."""

    name: str
    clock: HLC
    wall: FakeWall
    skew: int
    map: LWWMap

    def receive(self, e: Entry) -> None:
        if self.map.merge(e):
            self.clock.observe(e.hlc)


def make_writers(skews: list[int], t0: int = 1_700_000_000_000) -> list[Writer]:
    out = []
    for i, skew in enumerate(skews):
        wall = FakeWall(t0 + skew)
        out.append(Writer(f"n{i + 1}", HLC(wall=wall), wall, skew, LWWMap()))
    return out


ops = st.tuples(
    st.integers(0, 9),  # writer (mod the number of writers)
    keys,
    st.booleans(),  # delete?
    st.binary(max_size=4),
    st.integers(0, 20),  # ms of simulated time before the op
)


@settings(max_examples=100, deadline=None)
@given(
    skews=st.lists(st.integers(-500, 500), min_size=2, max_size=5),
    script=st.lists(ops, min_size=1, max_size=40),
    rnd=st.randoms(use_true_random=False),
)
def test_replicas_converge_after_anti_entropy_despite_loss_reorder_and_duplicates(
    skews: list[int], script: list[tuple[int, str, bool, bytes, int]], rnd: random.Random
) -> None:
    nodes = make_writers(skews)
    inbox: list[list[Entry]] = [[] for _ in nodes]
    log: list[Entry] = []
    now = 1_700_000_000_000
    for who, key, is_delete, value, dt in script:
        now += dt
        w = nodes[who % len(nodes)]
        for n in nodes:
            n.wall.ms = now + n.skew
        # Deliver a random part of what reached this writer, in random order.
        box = inbox[who % len(nodes)]
        rnd.shuffle(box)
        for _ in range(rnd.randint(0, len(box))):
            w.receive(box.pop())
        hlc = w.clock.now()
        e = w.map.delete(key, hlc, w.name) if is_delete else w.map.put(key, value, hlc, w.name)
        log.append(e)
        # Publish: each subscriber gets it zero, one or two times.
        for j in range(len(nodes)):
            if nodes[j] is not w:
                inbox[j].extend([e] * rnd.choice([0, 0, 1, 1, 1, 2]))
    for n, box in zip(nodes, inbox, strict=True):
        rnd.shuffle(box)
        for e in box:
            n.receive(e)
    maps = [n.map for n in nodes]
    # Some random exchanges first, then enough of them to guarantee convergence.
    for _ in range(rnd.randint(0, 6)):
        a, b = rnd.sample(maps, 2)
        anti_entropy(a, b)
    ring_sync(maps)
    reference = LWWMap(log)
    for m in maps:
        assert_same(m, reference)


@st.composite
def writer_streams(draw: st.DrawFn) -> list[list[Entry]]:
    """Per-writer streams of writes and deletes, stamped by each writer's own HLC."""
    nodes = make_writers(draw(st.lists(st.integers(-500, 500), min_size=1, max_size=4)))
    streams: list[list[Entry]] = [[] for _ in nodes]
    now = 1_700_000_000_000
    for who, key, is_delete, value, dt in draw(st.lists(ops, max_size=40)):
        now += dt
        i = who % len(nodes)
        w = nodes[i]
        w.wall.ms = now + w.skew
        hlc = w.clock.now()
        streams[i].append(Entry(key, hlc, w.name, None if is_delete else value))
    return streams


def in_order_prefixes(streams: list[list[Entry]], data: st.DataObject) -> list[Entry]:
    """A prefix of each writer's stream, interleaved at random but in order per writer."""
    queues = [list(s[: data.draw(st.integers(0, len(s)))]) for s in streams]
    out: list[Entry] = []
    while any(queues):
        q = data.draw(st.sampled_from([q for q in queues if q]))
        out.append(q.pop(0))
    return out


@settings(max_examples=150, deadline=None)
@given(streams=writer_streams(), data=st.data())
def test_since_version_vector_gives_what_an_in_order_replica_lacks(
    streams: list[list[Entry]], data: st.DataObject
) -> None:
    r = LWWMap(in_order_prefixes(streams, data))
    s = LWWMap(in_order_prefixes(streams, data))
    expected = join(r, s)
    delta = s.since(r.version_vector())
    assert all(e in list(s.entries()) for e in delta)
    r.merge_many(delta)
    assert_same(r, expected)
    assert s.since(s.version_vector()) == []


# -- tombstones and digests -------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    key=keys,
    value=st.binary(max_size=4),
    w_write=writers,
    w_delete=writers,
    t_write=st.integers(0, 1000),
    later=st.integers(1, 1000),
)
def test_tombstone_beats_older_writes(
    key: str, value: bytes, w_write: str, w_delete: str, t_write: int, later: int
) -> None:
    write = Entry(key, t_write, w_write, value)
    tomb = Entry(key, t_write + later, w_delete, None)
    for order in ([write, tomb], [tomb, write]):
        m = LWWMap(order)
        assert key not in m
        assert m.value(key) is None
        assert m.get(key) == tomb
        assert list(m.live()) == []
        assert list(m.tombstones()) == [tomb]


@settings(max_examples=200, deadline=None)
@given(
    key=keys,
    value=st.binary(max_size=4),
    w_write=writers,
    w_delete=writers,
    t_delete=st.integers(0, 1000),
    later=st.integers(1, 1000),
)
def test_tombstone_loses_to_newer_writes(
    key: str, value: bytes, w_write: str, w_delete: str, t_delete: int, later: int
) -> None:
    tomb = Entry(key, t_delete, w_delete, None)
    write = Entry(key, t_delete + later, w_write, value)
    for order in ([write, tomb], [tomb, write]):
        m = LWWMap(order)
        assert key in m
        assert m.value(key) == value
        assert list(m.tombstones()) == []


def test_equal_clocks_break_ties_on_writer_then_tombstone() -> None:
    a = Entry("k", 5, "n1", b"from n1")
    b = Entry("k", 5, "n2", b"from n2")
    assert LWWMap([a, b]).get("k") == b == LWWMap([b, a]).get("k")
    live = Entry("k", 5, "n1", b"v")
    tomb = Entry("k", 5, "n1", None)
    assert LWWMap([live, tomb]).get("k") == tomb == LWWMap([tomb, live]).get("k")


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.one_of(entries.map(lambda e: ("merge", e)), st.integers(0, 45).map(lambda s: ("gc", s))),
        max_size=40,
    )
)
def test_incremental_digest_matches_a_rebuild_from_scratch(steps: list[tuple]) -> None:
    m = LWWMap()
    for kind, arg in steps:
        if kind == "merge":
            m.merge(arg)
        else:
            m.collect(arg, WRITERS)
        fresh = LWWMap(m.entries())
        assert fresh.same_state(m)
        assert m.digest() == fresh.digest()
        assert len(m.digest()) == N_BUCKETS
        root = 0
        for b in m.digest():
            root ^= b
        assert m.root() == root


# Entries from wide alphabets. The explicit example pins a collision the hash once had:
# key, clock, writer and value were fed to it unseparated, so a writer "w\x01x" with a
# tombstone hashed like writer "w" with value b"x\x00" (equal digests, unequal states).
wide_entries = st.builds(
    Entry,
    key=st.text(max_size=6),
    hlc=st.integers(0, 2**64 - 1),
    writer=st.text(max_size=6),
    value=st.one_of(st.none(), st.binary(max_size=6)),
)
COLLIDED = (Entry("k", 1, "w\x01x", None), Entry("k", 1, "w", b"x\x00"))


@settings(max_examples=300, deadline=None)
@given(a=wide_entries, b=wide_entries)
@example(a=COLLIDED[0], b=COLLIDED[1])
@example(a=Entry("a\x00", 1, "b", None), b=Entry("a", 1, "\x00b", None))
def test_distinct_entries_hash_differently(a: Entry, b: Entry) -> None:
    assert (entry_hash(a) == entry_hash(b)) == (a == b)


@settings(max_examples=200, deadline=None)
@given(a=states, b=states)
@example(a=LWWMap([COLLIDED[0]]), b=LWWMap([COLLIDED[1]]))
def test_equal_digests_iff_same_state(a: LWWMap, b: LWWMap) -> None:
    assert (a.digest() == b.digest()) == a.same_state(b)


@settings(max_examples=200, deadline=None)
@given(a=states, b=states)
def test_diff_sends_exactly_the_buckets_that_differ(a: LWWMap, b: LWWMap) -> None:
    differing = {i for i, (x, y) in enumerate(zip(a.digest(), b.digest(), strict=True)) if x != y}
    assert set(b.differing_buckets(a.digest())) == differing
    sent = b.diff(a.digest())
    assert sorted(sent, key=Entry.order) == sorted(
        (e for e in b.entries() if bucket_of(e.key) in differing), key=Entry.order
    )
    assert a.diff(a.digest()) == []


def test_diff_refuses_a_digest_of_the_wrong_size() -> None:
    with pytest.raises(ValueError):
        LWWMap().diff([0] * (N_BUCKETS - 1))


# -- tombstone collection ---------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(log=entry_lists, stable=st.integers(0, 45), lower=st.integers(0, 45))
def test_collect_drops_only_tombstones_below_the_horizon(
    log: list[Entry], stable: int, lower: int
) -> None:
    m = LWWMap(log)
    before = list(m.entries())
    dropped = m.collect(stable, WRITERS)
    gone = [e for e in before if e.is_tombstone and e.hlc < stable]
    assert dropped == len(gone)
    assert sorted(m.entries(), key=Entry.order) == sorted(
        (e for e in before if e not in gone), key=Entry.order
    )
    assert m.horizon == max(stable, 0)
    # The horizon never moves back.
    assert m.collect(min(lower, stable), WRITERS) == 0
    assert m.horizon == max(stable, 0)


@settings(max_examples=200, deadline=None)
@given(stable=st.integers(1, 1000), below=st.integers(1, 1000), value=st.binary(max_size=4))
def test_horizon_refuses_stale_entries_only_for_keys_not_held(
    stable: int, below: int, value: bytes
) -> None:
    m = LWWMap([Entry("held", 0, "n1", b"old")])
    m.collect(stable, ["n1", "n2"])
    stale = max(stable - below, 0)
    assert not m.merge(Entry("gone", stale, "n2", value))
    assert m.rejected_below_horizon == 1
    assert "gone" not in m
    # A key the map holds still follows plain LWW below the horizon (n2 beats n1 at 0).
    assert m.merge(Entry("held", stale, "n2", value))
    assert m.rejected_below_horizon == 1
    # At or above the horizon is a genuinely new write: accepted.
    assert m.merge(Entry("gone", stable, "n2", value))
    assert m.value("gone") == value


@settings(max_examples=100, deadline=None)
@given(
    n_keys=st.integers(1, 6),
    n_deleted=st.integers(1, 6),
    skews=st.lists(st.integers(-500, 500), min_size=2, max_size=4),
    rnd=st.randoms(use_true_random=False),
)
def test_collected_tombstone_cannot_be_resurrected_by_a_stale_replica(
    n_keys: int, n_deleted: int, skews: list[int], rnd: random.Random
) -> None:
    nodes = make_writers(skews)
    maps = [n.map for n in nodes]

    def tick(ms: int) -> None:
        for n in nodes:
            n.wall.ms += ms

    def sync_all() -> None:
        # Anti-entropy between nodes, folding the clocks in as a node does.
        for _ in range(2):
            for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True):
                for e in b.map.diff(a.map.digest()):
                    a.receive(e)
                for e in a.map.diff(b.map.digest()):
                    b.receive(e)

    keys_ = [f"instance/{i}" for i in range(n_keys)]
    for k in keys_:
        tick(rnd.randint(0, 5))
        w = rnd.choice(nodes)
        w.map.put(k, b"v1", w.clock.now(), w.name)
    sync_all()
    stale = maps[0].copy()  # a node that then drops off the network with this state
    deleted = rnd.sample(keys_, min(n_deleted, n_keys))
    for k in deleted:
        tick(rnd.randint(0, 5))
        w = rnd.choice(nodes)
        w.map.delete(k, w.clock.now(), w.name)
    sync_all()
    tombs = {e.key: e.hlc for e in maps[0].tombstones()}
    assert set(tombs) == set(deleted)

    # Every member has synced everything, so each publishes its clock as ``synced``.
    tick(1)
    synced = {n.name: n.clock.now() for n in nodes}
    stable = stable_horizon(synced)
    assert stable == min(synced.values())
    assert all(t < stable for t in tombs.values())
    for m in maps:
        assert m.collect(stable, synced) == len(deleted)
    for m in maps[1:]:
        assert_same(m, maps[0])
    assert list(maps[0].tombstones()) == []
    settled = maps[0].copy()

    # The stale node comes back: anti-entropy as a node does it, both ways.
    for m in maps:
        before = m.rejected_below_horizon
        m.merge_many(stale.diff(m.digest()))
        assert m.rejected_below_horizon - before == len(deleted)
        stale.merge_many(m.diff(stale.digest()))
        assert_same(m, settled)
        for k in deleted:
            assert k not in m

    # A genuinely newer write for a deleted key is accepted, and spreads.
    tick(1)
    w = rnd.choice(nodes)
    w.map.put(deleted[0], b"v2", w.clock.now(), w.name)
    sync_all()
    for m in maps:
        assert m.value(deleted[0]) == b"v2"


@given(synced=st.dictionaries(st.text(max_size=4), st.integers(0, 2**63)))
@settings(max_examples=100, deadline=None)
def test_stable_horizon_is_the_minimum_synced_clock(synced: dict[str, int]) -> None:
    assert stable_horizon(synced) == (min(synced.values()) if synced else 0)


@settings(max_examples=200, deadline=None)
@given(stable=st.integers(1, 1000), below=st.integers(1, 1000), value=st.binary(max_size=4))
def test_horizon_takes_old_entries_of_a_writer_that_was_never_a_member(
    stable: int, below: int, value: bytes
) -> None:
    """A node that ran alone and joins late brings entries older than the horizon: they
    were never part of the agreement, so they are news, not stale copies."""
    m = LWWMap()
    m.collect(stable, ["n1", "n2"])
    old = max(stable - below, 0)
    assert m.merge(Entry("instance/new", old, "n3", value))
    assert m.value("instance/new") == value
    assert m.rejected_below_horizon == 0
    # Once n3 is a member when the horizon moves again, it is covered like the others.
    m.collect(stable + 1, ["n1", "n2", "n3"])
    assert not m.merge(Entry("instance/gone", old, "n3", value))
    assert m.rejected_below_horizon == 1


def test_horizon_exempt_merge_takes_an_old_entry_for_a_missing_key() -> None:
    m = LWWMap()
    m.collect(100, ["n1"])
    assert not m.merge(Entry("node/n1", 5, "n1", b"card"))
    assert m.merge(Entry("node/n1", 5, "n1", b"card"), exempt=True)
    assert m.value("node/n1") == b"card"


def test_copy_keeps_the_horizon_and_its_writers() -> None:
    m = LWWMap()
    m.collect(100, ["n1"])
    c = m.copy()
    assert (c.horizon, c.covered) == (100, {"n1"})
    assert not c.merge(Entry("x", 5, "n1", b"v"))
