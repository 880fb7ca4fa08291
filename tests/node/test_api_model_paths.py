"""A path named through the API is read only under the node's model roots; outside
them it is "not here", the same whether or not the file exists, and it does not become
a root. In this process: one node's state on real sockets, its real Instances."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from meshd.crdt.views import InstanceSpec
from meshd.models import ModelNotFoundError
from meshd.node.config import NodeConfig
from meshd.node.instances import Instances
from meshd.node.roots import ModelRoots

from .local import local_node


async def test_a_path_outside_the_roots_is_not_here_whether_or_not_it_exists(
    tmp_path: Path, model_path: Path
) -> None:
    outside, models = tmp_path / "outside", tmp_path / "models"
    outside.mkdir()
    models.mkdir()
    there = outside / "passwd.gguf"
    there.write_text("root:x:0:0:root:/root:/bin/bash\n")
    absent = outside / "no-such.gguf"
    mine = models / "smol.gguf"
    os.link(model_path, mine) if same_disk(model_path, models) else shutil.copy(model_path, mine)
    async with local_node() as n:
        roots = ModelRoots(dirs=[models])
        instances = Instances(n.state, NodeConfig(), cache_dir=tmp_path / "cache",
                              aborted=lambda: None, roots=roots)  # fmt: skip
        said = []
        for path in (there, absent):
            with pytest.raises(ModelNotFoundError) as e:
                await instances.facts(str(path))
            said.append(str(e.value).replace(str(path), "PATH"))
            with pytest.raises(ModelNotFoundError):
                await instances.place_requested(InstanceSpec(model=str(path)))
            with pytest.raises(ModelNotFoundError):
                await instances.instance_for(str(path), wait=0)
        assert said[0] == said[1]
        assert "root:x" not in said[0] and str(outside) not in said[0]
        # Asked through the API, it did not become a root.
        with pytest.raises(ModelNotFoundError):
            roots.resolve(str(there))
        # Under a root, the owner's own file is read.
        assert (await instances.facts(str(mine))).architecture == "llama"


def same_disk(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev
