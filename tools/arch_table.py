"""Print docs/operations.md's table of architectures x engines x what meshd does with
them, from the rules the code itself follows.

Run from the repository root: ``python3 tools/arch_table.py``. Each cell is one of
those rules applied: which engines build the architecture from its format
(``meshd.domain.builds``), whether placement cuts it into stages
(``meshd.placement.support.split_refusal``, ``cut_period``), whether its requests speculate, reuse a
cached prefix and share one prompt's prefill among ``n`` choices
(``meshd.domain.recurrent``), and whether MLX stages batch its requests. A test holds
the doc's table to this output (tests/test_arch_table.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshd.domain.builds import (
    LLAMA_CPP_NO_TEXT,
    MLX_BATCHED_ARCHITECTURES,
    MLX_FOLDER_ARCHITECTURES,
    buildable_engines,
)
from meshd.domain.facts import ModelFacts
from meshd.domain.recurrent import RECURRENT_ARCHITECTURES, state_refusals
from meshd.placement.support import SPLIT_PROVEN, cut_period, known_split_breaks, split_refusal

#: GGUF architectures households run (issue #32) beside those a rule names.
HOUSEHOLD = ("deepseek2", "glm4moe", "gpt-oss", "llama4", "mistral3", "olmo2", "smollm3")

BEGIN = "<!-- architecture table: python3 tools/arch_table.py -->"
END = "<!-- end of architecture table -->"


def _row(fmt: str, arch: str) -> str:
    engines = buildable_engines(fmt, arch)
    facts = ModelFacts(name=arch, sha256="", format=fmt, architecture=arch, n_layers=1,
                       hidden_size=1, n_ctx_train=0, layer_bytes=[0])  # fmt: skip
    state = state_refusals(arch)
    split = "no" if split_refusal(facts) is not None else "yes"
    if split == "yes" and (period := cut_period(facts)) > 1:
        split = f"every {period} layers"
    cells = [
        "GGUF" if fmt == "gguf" else "folder",
        f"`{arch}`",
        ", ".join(engines) or "none",
        "yes" if engines else "no",
        "-" if not engines else split,
        "-" if not engines else ("no" if "speculation" in state else "yes"),
        "-" if not engines else ("no" if "prefix_cache" in state else "yes"),
        "-" if "mlx" not in engines else ("yes" if arch in MLX_BATCHED_ARCHITECTURES else "no"),
    ]
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    """The table, as markdown, between its two marker lines."""
    gguf = sorted(
        SPLIT_PROVEN["gguf"]
        | set(known_split_breaks())
        | RECURRENT_ARCHITECTURES
        | set(LLAMA_CPP_NO_TEXT)
        | set(HOUSEHOLD)
    )
    folders = sorted(MLX_FOLDER_ARCHITECTURES)
    lines = [
        BEGIN,
        "| format | architecture | engines | whole | split | speculation | prefix cache "
        "| MLX batching |",
        "|---|---|---|---|---|---|---|---|",
        *(_row("gguf", a) for a in gguf),
        *(_row("mlx", a) for a in folders),
        "| GGUF | any other llama.cpp knows | llama_cpp | yes | no | yes | yes | - |",
        END,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
