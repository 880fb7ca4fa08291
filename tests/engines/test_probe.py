"""The backend probe, for real: a subprocess that imports the engines and prints what
they report, backends and GPUs, which the node puts in its card."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from meshd.crdt.views import NodeCard
from meshd.domain.nodes import Device
from meshd.engines import probe as probe_module
from meshd.engines.probe import PROBE_CACHE, Probed, detect_devices, llama_devices, probe

pytestmark = pytest.mark.timeout(120)


def test_the_probe_reports_the_backends_and_the_gpus_the_engines_see() -> None:
    found = asyncio.run(probe())
    assert isinstance(found, Probed)
    assert "llama_cpp-cpu" in found.backends and "mlx-cpu" in found.backends
    gpus = [b for b in found.backends if not b.endswith("-cpu")]
    if not gpus:  # these machines: no GPU is claimed, none invented
        assert found.devices == []
    for d in found.devices:
        assert d.backend in gpus and d.mem_total >= d.mem_free >= 0
    # The subprocess prints one JSON object.
    out = subprocess.run([sys.executable, "-m", "meshd.engines.probe"],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert msgspec.json.decode(out.stdout.strip().splitlines()[-1])["backends"] == found.backends


def test_llama_cpp_lists_only_its_gpus() -> None:
    # The real ggml registry of this build: a CPU device, which is not a GPU.
    assert llama_devices("llama_cpp-cuda") == []
    assert detect_devices(["llama_cpp-cpu", "mlx-cpu"]) == []


def test_a_card_carries_its_gpus_and_an_old_card_reads_without() -> None:
    d = Device(backend="llama_cpp-cuda", name="CUDA0", description="RTX 4090",
               mem_total=24 << 30, mem_free=23 << 30)  # fmt: skip
    card = NodeCard(id="n", name="n", incarnation="i", cluster="c", version="0", os="linux",
                    arch="x86_64", cpu_count=8, mem_total=64 << 30, mem_available=60 << 30,
                    backends=["llama_cpp-cpu", "llama_cpp-cuda"], devices=[d], mesh_port=1,
                    pub_port=2, api_port=3)  # fmt: skip
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(card), type=NodeCard)
    assert back.devices == [d]
    old = msgspec.structs.replace(card, devices=[])
    assert "devices" not in msgspec.msgpack.decode(msgspec.msgpack.encode(old))


def test_an_answer_without_a_gpu_is_kept_until_the_engines_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = asyncio.run(probe(cache_dir=tmp_path))
    assert "llama_cpp-cpu" in found.backends and (tmp_path / PROBE_CACHE).is_file()

    async def no_subprocess(timeout: float) -> Probed:
        raise AssertionError("probed again")

    # The next start takes the kept answer, without the subprocess.
    monkeypatch.setattr(probe_module, "_probe", no_subprocess)
    assert asyncio.run(probe(cache_dir=tmp_path)) == found
    # Other engines installed: probed again.
    monkeypatch.setattr(probe_module, "install_key", lambda: "another install")
    with pytest.raises(AssertionError, match="probed again"):
        asyncio.run(probe(cache_dir=tmp_path))


def test_an_answer_with_a_gpu_is_never_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = Device(backend="llama_cpp-cuda", name="CUDA0", mem_total=8 << 30, mem_free=7 << 30)

    async def with_a_gpu(timeout: float) -> Probed:
        return Probed(["llama_cpp-cpu", "llama_cpp-cuda"], [gpu])

    monkeypatch.setattr(probe_module, "_probe", with_a_gpu)
    assert asyncio.run(probe(cache_dir=tmp_path)).devices == [gpu]
    assert not (tmp_path / PROBE_CACHE).exists()
