"""A content id from the network names cache paths: only a sha256 in hex ever does.

Pure: the real decoders of the wire and of the shared map, and the path sinks, fed the
values a member could write.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from meshd.crdt.views import Instance, InstanceSpec, Stage, decode, encode
from meshd.domain.facts import ModelFacts
from meshd.models.folder_slicing import folder_slice_dir, folder_slice_path
from meshd.models.slicing import slice_path
from meshd.transport import wire
from meshd.transport.wire import FrameError

GOOD = "ab" * 32
BAD = [
    "../../../../tmp/pwned" + "0" * 43,
    "/etc/cron.d/" + "a" * 52,
    "AB" * 32,
    "ab" * 31,
    "ab" * 33,
    "ab" * 32 + "\n",
]


def _facts(sha: str) -> ModelFacts:
    return ModelFacts(name="m", sha256=sha, n_layers=2, hidden_size=8, n_ctx_train=64,
                      layer_bytes=[1, 1])  # fmt: skip


@pytest.mark.parametrize("sha", BAD)
def test_a_slice_ask_naming_no_sha256_does_not_decode(sha: str) -> None:
    ask = wire.SliceAsk(model="m", sha256=sha, start=0, end=1, version=1)
    with pytest.raises(FrameError):
        wire.decode_transfer(wire.encode(ask))
    good = wire.SliceAsk(model="m", sha256=GOOD, start=0, end=1, version=1)
    assert wire.decode_transfer(wire.encode(good)) == good


@pytest.mark.parametrize("sha", BAD)
def test_a_plan_whose_facts_name_no_sha256_is_dropped(sha: str) -> None:
    def plan(s: str) -> Instance:
        return Instance(id="i", spec=InstanceSpec(model="m"), facts=_facts(s),
                        stages=[Stage(node="n1", start=0, end=2, engine="llama_cpp")])  # fmt: skip

    assert decode(encode(plan(sha)), Instance) is None
    assert decode(encode(plan(GOOD)), Instance) == plan(GOOD)
    # "" (not known) still decodes: it names no path (the sinks below refuse it).
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(_facts("")), type=ModelFacts).sha256 == ""


@pytest.mark.parametrize("sha", [*BAD, ""])
def test_no_cache_path_is_named_by_anything_but_a_sha256(tmp_path: Path, sha: str) -> None:
    for sink in (slice_path, folder_slice_path, folder_slice_dir):
        with pytest.raises(ValueError, match="not a sha256"):
            sink(tmp_path, sha, 0, 1)
        assert sink(tmp_path, GOOD, 0, 1).parent == tmp_path / GOOD[:16]
