"""``meshctl models`` rows and table from a ``GET /v1/cluster`` document (pure)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from meshd.cli.models import model_rows, models_table

FACTS = {"name": "synth", "sha256": "ab" * 32, "format": "gguf", "n_layers": 2,
         "layer_bytes": [1 << 20, 1 << 20], "embed_bytes": 1 << 19, "head_bytes": 0}  # fmt: skip


def node(nid: str, name: str, liveness: str, models: list[str], **extra: Any) -> dict[str, Any]:
    card = {"id": nid, "name": name, "models": models, "model_facts": extra.get("facts", [])}
    return {"id": nid, "name": name, "liveness": liveness, "card": card,
            "health": {"runners": extra.get("runners", [])}}  # fmt: skip


def test_rows_say_who_holds_what_and_whether_it_is_served() -> None:
    ready = {"instance": "i1", "generation": 2, "stage": 0, "state": "ready"}
    cluster = {
        "nodes": [
            node("n1", "a", "alive", ["synth", "smollm2-135m"], facts=[FACTS], runners=[ready]),
            node("n2", "b", "suspect", ["smollm2-135m"]),
            node("n3", "c", "dead", ["gone-model"]),  # a dead node holds nothing
        ],
        "instances": [
            {"id": "i1", "spec": {"model": "synth"}, "generation": 2,
             "stages": [{"node": "n1", "start": 0, "end": 2, "engine": "llama_cpp"}]},
            {"id": "i2", "spec": {"model": "/x/placed.gguf"}, "generation": 1,
             "stages": [{"node": "n2", "start": 0, "end": 2, "engine": "llama_cpp"}]},
        ],
    }  # fmt: skip
    rows = model_rows(cluster)
    by = {r["model"]: r for r in rows}
    assert list(by) == ["/x/placed.gguf", "smollm2-135m", "synth"]
    assert by["synth"]["nodes"] == ["a"] and by["synth"]["serving"] == "ready"
    assert (by["synth"]["format"], by["synth"]["size"]) == ("gguf", (2 << 20) + (1 << 19))
    assert by["synth"]["sha256"] == "ab" * 32 and by["synth"]["instances"] == ["i1"]
    assert by["smollm2-135m"]["nodes"] == ["a", "b"] and by["smollm2-135m"]["serving"] == ""
    assert by["smollm2-135m"]["sha256"] is None  # no holder has read its facts yet
    assert by["/x/placed.gguf"]["nodes"] == [] and by["/x/placed.gguf"]["serving"] == "loading"

    console = Console(record=True, width=120)
    console.print(models_table(rows))
    text = console.export_text()
    assert "synth" in text and "2.5 MiB" in text and "ready (i1)" in text
    assert "a, b" in text


def test_a_mixture_of_experts_shows_the_bytes_a_token_reads_beside_its_size() -> None:
    moe = {**FACTS, "name": "moe", "layer_active_bytes": [1 << 18, 1 << 18]}
    cluster = {"nodes": [node("n1", "a", "alive", ["moe", "synth"], facts=[moe, FACTS])],
               "instances": []}  # fmt: skip
    by = {r["model"]: r for r in model_rows(cluster)}
    assert (by["moe"]["size"], by["moe"]["active"]) == ((2 << 20) + (1 << 19), 1 << 20)
    assert by["synth"]["active"] == by["synth"]["size"]  # dense: all of it
    console = Console(record=True, width=120)
    console.print(models_table(list(by.values())))
    text = console.export_text()
    assert "2.5 MiB (1.0 MiB active)" in text and text.count("active") == 1
