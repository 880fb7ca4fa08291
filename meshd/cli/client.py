"""A small typed HTTP client of one meshd node, used by ``meshctl``.

``meshctl`` never re-implements API logic: every command is a request to a node's HTTP
API, and this module is the one place that makes those requests and turns transport
failures into errors a user can read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from meshd.domain.text import loggable, printable

if TYPE_CHECKING:
    import httpx

#: Port a node serves its HTTP API on unless told otherwise.
DEFAULT_PORT = 7470
DEFAULT_HOST = "127.0.0.1"
#: Environment variable that replaces the default node (``--node`` still wins).
NODE_ENV = "MESHCTL_NODE"
#: Seconds to wait for a node before calling it unreachable.
DEFAULT_TIMEOUT = 5.0
#: The header of the admin credential (``meshd.api.auth.ADMIN_HEADER``).
ADMIN_HEADER = "x-meshd-admin"
#: Characters of one string of an answer shown at most.
TEXT_LIMIT = 1024
#: ``meshctl``'s exit codes: success, the node answered with an error, the node cannot be
#: reached or the command line is wrong, interrupted.
EXIT_OK = 0
EXIT_NODE_ERROR = 1
EXIT_UNREACHABLE = 2
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: One streamed piece of a chat answer: ``("reasoning" | "content", text)``.
Delta = tuple[str, str]


class MeshctlError(Exception):
    """Base of the errors ``meshctl`` reports as one line instead of a traceback."""


class NodeUnreachable(MeshctlError):
    """The node did not answer: refused, timed out, unknown host, reset..."""

    def __init__(self, base_url: str, reason: str) -> None:
        self.base_url = base_url
        self.reason = reason
        super().__init__(
            f"cannot reach meshd node at {base_url}: {reason} — is `meshd up` running?"
        )


class NodeError(MeshctlError):
    """The node answered, but not with what was asked for (HTTP error, not JSON...)."""

    def __init__(
        self,
        base_url: str,
        path: str,
        message: str,
        status: int | None = None,
        *,
        method: str,
    ):
        self.base_url = base_url
        self.path = path
        self.status = status
        super().__init__(f"meshd node at {base_url}: {method} {path}: {message}")


def parse_node(spec: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """Base URL of the node to talk to, from a ``--node`` value.

    Accepts ``host:port``, ``:port`` (local host), ``host`` (default port), a bracketed
    IPv6 address with or without a port (``[::1]:7470``), a bare IPv6 address, or a full
    ``http://`` / ``https://`` URL, which is taken as written (its scheme's default port
    if it names none, its path as a prefix). With no ``spec`` (None or blank), the
    ``MESHCTL_NODE`` environment variable is used, then ``127.0.0.1:7470``.

    Raises ValueError for a value that cannot name a node (bad port, empty host...).
    """
    if spec is None or not spec.strip():
        environ = os.environ if env is None else env
        spec = (environ.get(NODE_ENV) or "").strip() or f"{DEFAULT_HOST}:{DEFAULT_PORT}"
    spec = spec.strip()

    if "://" in spec:
        parts = urlsplit(spec)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported scheme in node URL {spec!r} (use http:// or https://)")
        if not parts.hostname:
            raise ValueError(f"no host in node URL {spec!r}")
        try:
            parts.port  # noqa: B018 -- validates the port
        except ValueError as exc:
            raise ValueError(f"bad port in node URL {spec!r}") from exc
        return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"

    host, port = _split_host_port(spec)
    if not host:
        host = DEFAULT_HOST
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _split_host_port(spec: str) -> tuple[str, int]:
    if spec.startswith("["):  # [v6] or [v6]:port
        end = spec.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in node address {spec!r}")
        host, rest = spec[1:end], spec[end + 1 :]
        if not host:
            raise ValueError(f"empty IPv6 address in {spec!r}")
        if not rest:
            return host, DEFAULT_PORT
        if not rest.startswith(":"):
            raise ValueError(f"unexpected {rest!r} after ']' in node address {spec!r}")
        return host, _port(rest[1:], spec)
    if spec.count(":") > 1:  # bare IPv6 literal, no port
        return spec, DEFAULT_PORT
    host, sep, port = spec.partition(":")
    if "/" in host or " " in host:
        raise ValueError(f"bad host in node address {spec!r}")
    return host, _port(port, spec) if sep else DEFAULT_PORT


def _port(text: str, spec: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port {text!r} in node address {spec!r} (want 1-65535)")
    return int(text)


class NodeClient:
    """Blocking HTTP client of one node's API.

    Every method returns the decoded JSON object, or raises NodeUnreachable when the
    node cannot be reached and NodeError when it answers with an error or non-JSON.
    Proxy environment variables are ignored: a node is on the local network.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        admin: str | None = None,
    ) -> None:
        """``api_key``: the node's API key (inference, reading); ``admin``: the owner
        token or the admin key, sent as ``x-meshd-admin`` (administration)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if admin:
            headers[ADMIN_HEADER] = admin
        # httpx is imported with the first client, not with this module: it takes
        # 0.2 s, and meshctl must start (--help, usage errors, `secret`) in 0.3 s.
        import httpx

        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout, trust_env=False, headers=headers
        )

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the underlying connection pool."""
        self._http.close()

    def healthz(self) -> dict[str, Any]:
        """``GET /healthz``: ``{"status": "ok", "node": "<id>", ...}``."""
        return self._get_json("/healthz")

    def cluster(self) -> dict[str, Any]:
        """``GET /v1/cluster``: this node's view of nodes, liveness and instances."""
        return self._get_json("/v1/cluster")

    def instances(self) -> dict[str, Any]:
        """``GET /v1/instances``."""
        return self._get_json("/v1/instances")

    def instance(self, instance_id: str) -> dict[str, Any]:
        """``GET /v1/instances/ID``."""
        return self._get_json(f"/v1/instances/{instance_id}")

    def doctor(self) -> dict[str, Any]:
        """``GET /v1/doctor``: findings and what was checked (the node probes its peers'
        ports first, about 1.5 s)."""
        return self._send("GET", "/v1/doctor", timeout=max(self.timeout, 10.0))

    def place(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/instances``: place a model; returns the instance."""
        # Placing reads the model's header (and hashes it the first time): allow time.
        return self._send("POST", "/v1/instances", body, timeout=max(self.timeout, 120.0))

    def remove(self, instance_id: str) -> dict[str, Any]:
        """``DELETE /v1/instances/ID``."""
        return self._send("DELETE", f"/v1/instances/{instance_id}")

    def members(self) -> dict[str, Any]:
        """``GET /v1/members``: members and nodes waiting for approval."""
        return self._get_json("/v1/members")

    def approve(self, code: str, node: str = "") -> dict[str, Any]:
        """``POST /v1/members``: approve the pending node that shows ``code``."""
        return self._send("POST", "/v1/members", {"approve": code, "node": node})

    def remove_member(self, ref: str) -> dict[str, Any]:
        """``DELETE /v1/members/REF``: remove a member for good."""
        return self._send("DELETE", f"/v1/members/{quote(ref, safe='')}")

    def invite(self) -> dict[str, Any]:
        """``POST /v1/invites``: a pairing code."""
        return self._send("POST", "/v1/invites", {})

    def chat_stream(
        self, body: dict[str, Any], timeout: float = 600.0
    ) -> Generator[Delta, None, None]:
        """``POST /v1/chat/completions`` with ``stream``: yield each delta as ``(kind,
        text)``, ``kind`` being ``"reasoning"`` (a thinking model's thoughts) or
        ``"content"`` (the answer).

        Closing the iterator early (Ctrl-C) closes the connection: the node cancels
        the request on every stage."""
        import httpx  # loaded by __init__ already (see there)

        path = "/v1/chat/completions"
        body = {**body, "stream": True}
        try:
            with self._http.stream("POST", path, json=body, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise NodeError(
                        self.base_url, path, _error_text(resp),
                        status=resp.status_code, method="POST",
                    )  # fmt: skip
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        err = ev["error"]
                        msg = err.get("message", "error") if isinstance(err, dict) else str(err)
                        raise NodeError(self.base_url, path, loggable(msg), method="POST")
                    for choice in ev.get("choices") or []:
                        delta = choice.get("delta") or {}
                        for kind, key in (
                            ("reasoning", "reasoning_content"),
                            ("content", "content"),
                        ):
                            if text := delta.get(key):
                                yield kind, text
        except httpx.TransportError as exc:
            raise NodeUnreachable(self.base_url, _reason(exc)) from exc

    def _get_json(self, path: str) -> dict[str, Any]:
        return self._send("GET", path)

    def _send(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> dict[str, Any]:
        import httpx  # loaded by __init__ already (see there)

        try:
            resp = self._http.request(method, path, json=body, timeout=timeout or self.timeout)
        except httpx.TransportError as exc:
            raise NodeUnreachable(self.base_url, _reason(exc)) from exc
        if resp.status_code >= 400:
            raise NodeError(
                self.base_url, path, _error_text(resp), status=resp.status_code, method=method
            )
        try:
            out = resp.json()
        except ValueError as exc:
            raise NodeError(
                self.base_url, path, f"answer is not JSON: {_snippet(resp.text)}", method=method
            ) from exc
        if not isinstance(out, dict):
            raise NodeError(
                self.base_url, path, f"expected a JSON object, got {type(out).__name__}",
                method=method,
            )  # fmt: skip
        return displayable(out)


def displayable(value: Any) -> Any:
    """``value`` (a node's decoded answer) with every string made :func:`printable`.

    Members wrote much of what a node answers (names, cards, reasons, model names):
    one of them must not reach this terminal as a newline, an escape sequence or a
    bidi override, in a table, in ``top`` or in ``--json`` output. (rich markup in a
    name is the table's concern: cells take :class:`rich.text.Text`, never markup.)
    """
    if isinstance(value, str):
        return printable(value, TEXT_LIMIT)
    if isinstance(value, list):
        return [displayable(v) for v in value]
    if isinstance(value, dict):
        return {displayable(k): displayable(v) for k, v in value.items()}
    return value


def _error_text(resp: httpx.Response) -> str:
    """``HTTP 404: <message>``, reading OpenAI's error shape when the body has it."""
    try:
        err = resp.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        msg = None
    return loggable(f"HTTP {resp.status_code}: {msg or _snippet(resp.text)}")


def _reason(exc: httpx.TransportError) -> str:
    import httpx  # loaded by NodeClient already (see there)

    text = str(exc).strip()
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({text})" if text and "timed out" not in text else text or "timed out"
    return text or type(exc).__name__


def _snippet(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
