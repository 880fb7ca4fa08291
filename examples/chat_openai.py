#!/usr/bin/env python3
"""Chat with a meshd node through the official ``openai`` client, streaming the answer.

    pip install openai
    python chat_openai.py "Tell me a joke"          # one question, one answer
    python chat_openai.py                           # a conversation; Ctrl-D quits
    python chat_openai.py --base-url http://studio.local:7470/v1 --model smollm2-135m

Any node of the cluster answers, whether or not it holds a stage of the model. A node
started with an API key wants that key: ``MESHD_API_KEY=KEY python chat_openai.py``
(a node without one takes any key, so the default is ``unused``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from openai import APIConnectionError, APIError, APIStatusError, OpenAI
from openai.types.chat import ChatCompletionMessageParam

DEFAULT_BASE_URL = "http://127.0.0.1:7470/v1"
DEFAULT_MODEL = "smollm2-135m"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Chat with a meshd node through the openai client (streamed)."
    )
    p.add_argument("prompt", nargs="*", help="one-shot prompt; none starts a conversation")
    p.add_argument(
        "--base-url", default=DEFAULT_BASE_URL, help="the node's /v1 (default: %(default)s)"
    )
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="model (default: %(default)s)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="default: %(default)s")
    p.add_argument("--temperature", type=float, help="default: the model's own")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (default: %(default)s)")
    return p.parse_args(argv)


def ask(client: OpenAI, args: argparse.Namespace, history: list[ChatCompletionMessageParam]) -> str:
    """Send the conversation, print the answer as it streams in, and return it."""
    if args.temperature is None:  # the model's own default
        stream = client.chat.completions.create(
            model=args.model, messages=history, max_tokens=args.max_tokens, stream=True
        )
    else:
        stream = client.chat.completions.create(
            model=args.model,
            messages=history,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=True,
        )
    parts: list[str] = []
    for chunk in stream:
        if not chunk.choices:
            continue
        text = chunk.choices[0].delta.content
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            parts.append(text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def turn(
    client: OpenAI, args: argparse.Namespace, history: list[ChatCompletionMessageParam], text: str
) -> bool:
    """One question and its answer, kept in ``history``; False (and why) if it failed."""
    history.append({"role": "user", "content": text})
    try:
        answer = ask(client, args, history)
    except APIConnectionError as exc:
        print(f"\ncannot reach {args.base_url} ({exc}); is `meshd up` running?", file=sys.stderr)
    except APIStatusError as exc:
        print(f"\nthe node answered {exc.status_code}: {exc.message}", file=sys.stderr)
    except APIError as exc:  # an error event in the middle of the stream
        print(f"\nthe answer failed: {exc.message}", file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C during an answer: drop it, keep the conversation
        print("\n(stopped)", file=sys.stderr)
    else:
        history.append({"role": "assistant", "content": answer})
        return True
    history.pop()
    return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    client = OpenAI(
        base_url=args.base_url,
        api_key=os.environ.get("MESHD_API_KEY") or "unused",
        timeout=args.timeout,
        max_retries=0,
    )
    history: list[ChatCompletionMessageParam] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    if args.prompt:
        return 0 if turn(client, args, history, " ".join(args.prompt)) else 1
    print(f"chatting with {args.model} at {args.base_url} (Ctrl-D to quit)")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip():
            turn(client, args, history, line)


if __name__ == "__main__":
    raise SystemExit(main())
