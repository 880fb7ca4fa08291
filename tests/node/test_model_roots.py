"""A node loads models from its own roots only, and says nothing of its disk.

A plan is any member's word, and names its model by a string: the node must not open a
file because a peer named it, nor tell a peer which files exist.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from meshd.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model
from meshd.node.roots import ModelRoots
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    try:
        src = Path(resolve_model(DEFAULT_MODEL).path)
    except LookupError:
        pytest.skip("the default model is not installed")
    out = tmp_path / "outside" / "smol.gguf"
    out.parent.mkdir()
    os.link(src, out) if src.stat().st_dev == out.parent.stat().st_dev else shutil.copy(src, out)
    return out


def test_roots_take_aliases_their_folders_and_what_the_node_was_given(
    tmp_path: Path, gguf: Path
) -> None:
    packaged = ModelRoots().resolve(DEFAULT_MODEL).path
    assert packaged.endswith(".gguf")
    assert ModelRoots().resolve(packaged).path == packaged  # by its path, too
    with pytest.raises(ModelNotFoundError) as there:
        ModelRoots().resolve(str(gguf))
    missing = gguf.parent / "no-such.gguf"
    with pytest.raises(ModelNotFoundError) as absent:
        ModelRoots().resolve(str(missing))
    # Nothing about the disk: a file that is there reads like one that is not.
    assert str(there.value).replace(str(gguf), "X") == str(absent.value).replace(str(missing), "X")
    assert ModelRoots(dirs=[gguf.parent]).resolve(str(gguf)).path == str(gguf)
    roots = ModelRoots(allowed=[str(gguf)])
    assert roots.resolve(str(gguf)).path == str(gguf)
    # A link the owner put in a root is in it (models linked in from a big disk), but
    # ".." does not climb out of a root.
    inside = tmp_path / "models"
    inside.mkdir()
    (inside / "linked.gguf").symlink_to(gguf)
    assert (
        ModelRoots(dirs=[inside]).resolve(str(inside / "linked.gguf")).path.endswith("linked.gguf")
    )
    with pytest.raises(ModelNotFoundError):
        ModelRoots(dirs=[inside]).resolve(str(inside / ".." / "outside" / "smol.gguf"))
    with pytest.raises(ModelNotFoundError):
        ModelRoots().resolve("/etc/passwd")


def test_a_plan_naming_a_file_outside_a_nodes_roots_moves_to_a_node_that_has_it(
    cluster: Cluster, gguf: Path
) -> None:
    a = cluster.start("a", extra_args=["--models", str(gguf.parent)])
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    # Placed through a's API (under a's roots), on b (whose roots it is not under).
    r = httpx.post(a.api + "/v1/instances", json={"model": str(gguf), "nodes": ["b"]},
                   timeout=120)  # fmt: skip
    assert r.status_code == 201, r.text
    iid = r.json()["id"]

    def moved() -> bool:
        inst = a.get(f"/v1/instances/{iid}")
        return [s["node"] for s in inst["stages"]] == [a.node_id] and all(
            s["state"] == "ready" for s in inst["stages"]
        )

    wait_for(moved, 60, interval=0.2)
    excluded = a.get(f"/v1/instances/{iid}")["excluded"]
    assert [x["node"] for x in excluded] == [b.node_id]
    assert excluded[0]["reason"] == "model not available here"
    health = next(n["health"] for n in a.cluster()["nodes"] if n["id"] == b.node_id)
    assert str(gguf.parent) not in str(health)  # b's heartbeat says nothing of its disk


def test_a_folder_given_with_models_is_a_root(cluster: Cluster, gguf: Path) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a], extra_args=["--models", str(gguf.parent)])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    # Named through b's API: a path is read only under the roots of the node asked.
    r = httpx.post(b.api + "/v1/instances", json={"model": str(gguf), "nodes": ["b"]},
                   timeout=120)  # fmt: skip
    assert r.status_code == 201, r.text
    iid = r.json()["id"]
    wait_for(lambda: all(s["state"] == "ready" and s["node"] == b.node_id
                         for s in a.get(f"/v1/instances/{iid}")["stages"]), 60)  # fmt: skip
