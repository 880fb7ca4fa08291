"""An MLX model folder for ``mlx_lm.server``, made offline from the same GGUF.

``mlx_lm.server`` loads a folder (``config.json``, ``model*.safetensors``, a Hugging Face
tokenizer); it does not read GGUF. Nothing may come from a hub, so the folder is made
here from the GGUF the other subjects run:

* weights: meshd's own ``MlxStage`` reads the GGUF with ``mx.load`` (Q4_0/Q4_1/Q8_0 as
  MLX affine-quantized weights, group 32, scales in f32 on the CPU as meshd does) into an
  mlx-lm llama ``Model``; its parameters are saved as they are, so ``mlx_lm.server``
  computes with exactly the weights meshd's MLX engine computes with;
* ``config.json``: that model's ``ModelArgs`` (``rope_traditional=True``: GGUF Q/K rows
  are in llama.cpp's rope order) plus the quantization mlx-lm infers per module;
* tokenizer: a byte-level BPE ``tokenizer.json`` built with ``tokenizers`` from the
  GGUF's vocabulary and merges (``tokenizer.ggml.model == "gpt2"`` only), its control
  tokens as special tokens and its chat template.

The folder is cached by the GGUF's size and mtime under ``$MESHD_BENCH_CACHE``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from _rpc import CACHE


class NotConvertible(RuntimeError):
    """The GGUF cannot become an MLX folder here (the reason is the message)."""


def mlx_missing() -> str | None:
    import importlib.util

    missing = [
        m for m in ("mlx", "mlx_lm", "tokenizers", "transformers", "gguf")
        if importlib.util.find_spec(m) is None
    ]  # fmt: skip
    return f"needs {', '.join(missing)}" if missing else None


def mlx_folder(gguf: Path, log=print) -> Path:
    """The MLX folder for ``gguf`` (made once, then reused)."""
    st = gguf.stat()
    out = CACHE / "mlx" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (out / "meshd-bench-done").exists():
        return out
    log(f"mlx: converting {gguf.name} to an MLX folder in {out}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    _tokenizer(gguf, out)
    _weights(gguf, out)
    (out / "meshd-bench-done").write_text(str(gguf) + "\n")
    return out


def _weights(gguf: Path, out: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from meshd.engines.mlx_stage import MlxStage, _FactorRoPE

    probe = _n_layers(gguf)
    stage = MlxStage(gguf, start=0, end=probe, first=True, last=True, n_ctx=512, n_seq_max=1)
    try:
        model = stage.mlx_model
        if any(isinstance(layer.self_attn.rope, _FactorRoPE) for layer in model.model.layers):
            raise NotConvertible("rope frequency factors have no mlx-lm config equivalent")
        params = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(out / "model.safetensors"), params)
        args = dataclasses.asdict(model.args)
        bits = sorted(
            {p[: -len(".scales")] for p in params if p.endswith(".scales")}
        )  # quantized modules; mlx-lm infers bits and group per module from shapes
        if bits:
            args["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
        (out / "config.json").write_text(json.dumps(args, indent=1, default=_json))
    finally:
        stage.close()


def _json(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(type(o).__name__)


def _n_layers(gguf: Path) -> int:
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    arch = r.fields["general.architecture"].contents()
    return int(r.fields[f"{arch}.block_count"].contents())


def _tokenizer(gguf: Path, out: Path) -> None:
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    r = GGUFReader(str(gguf))

    def field(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotConvertible(f"GGUF tokenizer {kind!r}: only byte-level BPE (gpt2) is rebuilt")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if field("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tk.decoder = decoders.ByteLevel()
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def tok(key: str) -> str | None:
        i = field(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=tok("bos"),
        eos_token=tok("eos"),
        unk_token=tok("unknown"),
        pad_token=tok("padding"),
        model_max_length=4096,
    )
    template = field("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(out))
