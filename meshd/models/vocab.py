"""A Hugging Face ``tokenizer.json`` as a stage vocabulary (the MLX folder engine's).

:class:`HfVocab` has the interface of :class:`~meshd.engines.llama_stage.LlamaVocab`
(``tokenize``, ``token_to_piece``, ``eos_tokens``, ``n_vocab``, ``close``), so the
runner, the detokenizer and the chat code do not care which one a stage holds. It
reads the folder with the ``tokenizers`` library (Rust, no torch) and follows
llama.cpp's rules where the two could disagree, so that a model gives the same ids,
pieces and stop set whether it is served from its GGUF or from its MLX folder:

- ``add_special`` adds BOS/EOS the way the model's tokenizer does: the post-processor
  of ``tokenizer.json``, rebuilt as transformers does when ``tokenizer_config.json``
  states ``add_bos_token``/``add_eos_token``.
- ``parse_special`` decides whether special-token text (``<|im_start|>``) becomes its
  id; without it the text is tokenized as text. Non-special added tokens are always
  matched whole (llama.cpp's USER_DEFINED tokens behave the same way).
- ``token_to_piece`` gives raw bytes, possibly part of a UTF-8 character: byte-level
  BPE tokens (GPT-2, Llama 3, SmolLM, Qwen) through the GPT-2 byte<->unicode map;
  sentencepiece-style tokens with ``\u2581`` for a space and ``<0xXX>`` byte tokens.
  Special tokens render as nothing unless ``special`` is set, as in llama.cpp.
- ``eos_tokens`` is the eos of ``tokenizer_config.json``, ``config.json`` and
  ``generation_config.json`` plus the tokens llama.cpp treats as end-of-generation by
  their text (``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``, FIM pad/repo/sep...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .errors import ModelFormatError

__all__ = ["EOG_TEXTS", "HfVocab", "byte_decoder"]

#: Token texts llama.cpp's vocabulary loader (llama-vocab.cpp) marks end-of-generation
#: whatever the metadata says: chat end-of-turn tokens and the FIM pad/repo/file-sep
#: tokens. Kept in step with llama.cpp so both engines stop on the same ids.
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        # FIM pad / repo / file separator, which llama.cpp adds to its EOG set.
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<PAD>",
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        "<|file_sep|>",
    }
)

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to bytes.

    Byte-level BPE spells every byte as a printable character: the printable Latin-1
    bytes as themselves, the other 68 as U+0100 onwards (``\u0120`` is a space).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _types(node: Any) -> set[str]:
    """Every ``type`` in a tokenizer.json component (nested Sequences included)."""
    found: set[str] = set()
    if isinstance(node, dict):
        t = node.get("type")
        if isinstance(t, str):
            found.add(t)
        for v in node.values():
            found |= _types(v)
    elif isinstance(node, list):
        for v in node:
            found |= _types(v)
    return found


def _spm_space(node: Any) -> bool:
    """Whether a decoder turns ``\u2581`` back into a space (sentencepiece style)."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace":
            return True
        if node.get("type") == "Replace" and "\u2581" in json.dumps(node, ensure_ascii=False):
            return True
        return any(_spm_space(v) for v in node.values())
    if isinstance(node, list):
        return any(_spm_space(v) for v in node)
    return False


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    """An ``eos_token_id`` entry: an int, a list of ints or nothing."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class HfVocab:
    """The tokenizer of a Hugging Face / MLX model folder (see the module docs).

    Not thread-safe (``parse_special`` toggles a flag of the one Rust tokenizer),
    like the stages that hold it.
    """

    def __init__(
        self,
        path: Path,
        tokenizer: Any,
        spec: dict[str, Any],
        tok_cfg: dict[str, Any],
        eos_ids: set[int],
    ) -> None:
        self.path = path
        self._tok: Any = tokenizer
        #: Token ids the tokenizer knows, added tokens included. A model's embedding
        #: may have more rows (padding); those ids render as nothing.
        self.n_vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._tok_cfg = tok_cfg
        model = spec.get("model") or {}
        self._byte_level = "ByteLevel" in _types(spec.get("decoder")) or "ByteLevel" in _types(
            spec.get("pre_tokenizer")
        )
        self._spm = not self._byte_level and (
            _spm_space(spec.get("decoder")) or _spm_space(spec.get("pre_tokenizer"))
        )
        self._byte_fallback = bool(model.get("byte_fallback"))
        self._bytes = byte_decoder() if self._byte_level else {}
        #: Added tokens: id -> (content, special).
        self._added: dict[int, tuple[str, bool]] = {}
        for t in spec.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("id"), int):
                self._added[t["id"]] = (str(t.get("content", "")), bool(t.get("special")))
        self._pieces: dict[int, bytes] = {}
        self._eos = set(eos_ids)

    @classmethod
    def load(cls, path: Path | str) -> HfVocab:
        """The tokenizer of the folder at ``path`` (``tokenizer.json`` and, when there,
        ``tokenizer_config.json``, ``config.json`` and ``generation_config.json``).

        Raises FileNotFoundError without a ``tokenizer.json`` and ModelFormatError for
        one that does not parse.
        """
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{path}: no tokenizer.json (a folder made by transformers' "
                "save_pretrained or mlx_lm.convert has one)"
            )
        spec = _read_json(file)
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:
            raise ModelFormatError(f"{file}: the tokenizers library cannot read it ({e})") from e
        tok_cfg = _read_json(path / "tokenizer_config.json")
        _apply_special_flags(tok, tok_cfg)
        tok.encode_special_tokens = False

        eos: set[int] = set()
        text = _token_text(tok_cfg.get("eos_token"))
        eos_id = None if text is None else tok.token_to_id(text)
        if eos_id is not None:
            eos.add(int(eos_id))
        for name in ("config.json", "generation_config.json"):
            eos.update(_ids(_read_json(path / name).get("eos_token_id")))
        for text in EOG_TEXTS:
            tid = tok.token_to_id(text)
            if tid is not None:
                eos.add(int(tid))
        return cls(path, tok, spec, tok_cfg, eos)

    # -- the LlamaVocab interface ---------------------------------------------------

    def _open(self) -> Any:
        if self._tok is None:
            raise RuntimeError("vocabulary is closed")
        return self._tok

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS as the model's tokenizer
        does, ``parse_special`` turns special-token text into its id."""
        tok = self._open()
        tok.encode_special_tokens = not parse_special
        try:
            return list(tok.encode(text, add_special_tokens=add_special).ids)
        finally:
            tok.encode_special_tokens = False

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (possibly part of a UTF-8 character).

        Special tokens give their text with ``special``, else nothing; ids past the
        tokenizer's (an embedding padded beyond the vocabulary) give nothing.
        """
        tok = self._open()
        token = int(token)
        if token < 0:
            raise ValueError(f"token id {token} is negative")
        added = self._added.get(token)
        if added is not None:
            content, is_special = added
            return content.encode("utf-8") if special or not is_special else b""
        piece = self._pieces.get(token)
        if piece is None:
            text = tok.id_to_token(token)
            piece = b"" if text is None else self._decode(text)
            self._pieces[token] = piece
        return piece

    def _decode(self, text: str) -> bytes:
        if self._byte_level:
            table = self._bytes
            if all(c in table for c in text):
                return bytes(table[c] for c in text)
            # A token outside the byte alphabet (a mislabelled special): its own text.
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in text)
        if self._spm:
            m = _BYTE_TOKEN.match(text)
            if m is not None and self._byte_fallback:
                return bytes([int(m.group(1), 16)])
            return text.replace("\u2581", " ").encode("utf-8")
        return text.encode("utf-8")

    def eos_tokens(self) -> set[int]:
        """eos ids of the folder's configs and every token llama.cpp calls
        end-of-generation by its text (:data:`EOG_TEXTS`)."""
        self._open()
        return set(self._eos)

    def close(self) -> None:
        """Drop the tokenizer. Safe to call twice."""
        self._tok = None
        self._pieces = {}

    # -- extras ---------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        """The BOS text of tokenizer_config.json (what chat templates get as ``bos_token``)."""
        return _token_text(self._tok_cfg.get("bos_token"))

    @property
    def eos_token(self) -> str | None:
        """The EOS text of tokenizer_config.json."""
        return _token_text(self._tok_cfg.get("eos_token"))


def _apply_special_flags(tok: Any, cfg: dict[str, Any]) -> None:
    """Rebuild the post-processor from ``add_bos_token``/``add_eos_token`` when the
    tokenizer config states them (transformers' Llama/Gemma tokenizers do the same;
    without the flags the post-processor of tokenizer.json stands)."""
    if "add_bos_token" not in cfg and "add_eos_token" not in cfg:
        return
    from tokenizers import processors

    single: list[str] = []
    pair: list[str] = []
    specials: list[tuple[str, int]] = []

    def add(key: str) -> str | None:
        if not cfg.get(f"add_{key}_token"):
            return None
        text = _token_text(cfg.get(f"{key}_token"))
        if text is None:
            return None
        tid = tok.token_to_id(text)
        if tid is None:
            return None
        if (text, tid) not in specials:
            specials.append((text, int(tid)))
        return text

    bos, eos = add("bos"), add("eos")
    for seq, out in (("A", single), ("B", pair)):
        if seq == "B":
            pair.extend(single)
        if bos is not None:
            out.append(f"{bos}:{1 if seq == 'B' else 0}")
        out.append(f"${seq}:{1 if seq == 'B' else 0}")
        if eos is not None:
            out.append(f"{eos}:{1 if seq == 'B' else 0}")
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials
    )
