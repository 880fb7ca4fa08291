"""What a node keeps of the cluster's placements (meshd.node.kept), on real replicas:
instances are kept with their settings, a removal is kept for good and names the very
instance removed, and the file survives a bad write."""

from __future__ import annotations

import json
from pathlib import Path

from meshd.crdt.replica import Replica
from meshd.crdt.views import Instance, InstanceSpec, Stage, instance_key
from meshd.node.kept import Kept, PlacementsFile, observe, stale

SPEC = InstanceSpec(model="m", context=1024, kv_cache="q8_0", speculate=False, exact=True,
                    nodes=["a"])  # fmt: skip


def _inst(r: Replica, iid: str, spec: InstanceSpec = SPEC, placed: int = 0) -> Instance:
    inst = Instance(
        id=iid, spec=spec, stages=[Stage(node="a", start=0, end=30, engine="llama")],
        placed=placed or r.clock.now(),
    )  # fmt: skip
    r.write(instance_key(iid), inst)
    return inst


def _observe(kept: Kept, r: Replica) -> Kept:
    return observe(kept, (e for e in r.map.entries() if e.key.startswith("instance/")))


def test_an_instance_is_kept_with_its_settings_until_a_newer_tombstone() -> None:
    r = Replica("a")
    inst = _inst(r, "x")
    kept = _observe(Kept(), r)
    assert kept.instances["x"].spec == SPEC and kept.instances["x"].placed == inst.placed
    # A repair keeps ``placed``: still the same instance.
    r.write(instance_key("x"), Instance(id="x", spec=SPEC, stages=[], generation=2,
                                        placed=inst.placed))  # fmt: skip
    kept = _observe(kept, r)
    assert set(kept.instances) == {"x"} and not kept.removed
    r.delete(instance_key("x"))
    kept = _observe(kept, r)
    assert not kept.instances and kept.removed == {"x": inst.placed}


def test_an_id_with_no_entry_stays_kept_for_the_restore() -> None:
    r = Replica("a")
    _inst(r, "x")
    kept = _observe(Kept(), r)
    fresh = Replica("a")  # the map after a restart: nothing heard yet
    assert _observe(kept, fresh).instances.keys() == {"x"}


def test_a_removed_instance_placed_again_is_stale_and_a_newer_one_is_not() -> None:
    r = Replica("a")
    old = _inst(r, "auto")
    kept = _observe(Kept(), r)
    r.delete(instance_key("auto"))
    kept = _observe(kept, r)
    # A node that was away places the old one again from its file: same id, same placed.
    back = Replica("b")
    again = _inst(back, "auto", placed=old.placed)
    assert stale(kept, [again]) == ["auto"]
    assert "auto" not in _observe(kept, back).instances
    # A later placement under the same id (an automatic one) is a new instance.
    new = _inst(r, "auto")
    assert new.placed > old.placed and stale(kept, [new]) == []
    assert _observe(kept, r).instances["auto"].placed == new.placed


def test_a_live_entry_placed_later_records_the_old_ones_removal() -> None:
    a, b = Replica("a"), Replica("b")
    old = _inst(a, "x")
    kept = _observe(Kept(), a)
    b.clock.observe(old.placed)  # b saw it, and its removal
    new = _inst(b, "x")  # the tombstone was collected while this node was away
    kept = _observe(kept, b)
    assert kept.instances["x"].placed == new.placed and kept.removed == {"x": old.placed}


def test_the_file_round_trips_and_a_corrupt_one_restores_nothing(tmp_path: Path) -> None:
    r = Replica("a")
    _inst(r, "x")
    kept = _observe(Kept(), r)
    f = PlacementsFile(tmp_path)
    f.save(kept)
    assert f.load() == kept
    assert (f.path.stat().st_mode & 0o777) == 0o600
    assert json.loads(f.path.read_text())["instances"]["x"]["spec"]["kv_cache"] == "q8_0"
    f.path.write_text('{"instances": {"x": 7}}')
    assert f.load() == Kept()
    f.path.write_bytes(b"\xff" * 10)
    assert f.load() == Kept()
