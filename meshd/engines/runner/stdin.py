"""The node's commands on the runner's stdin, one line each."""

from __future__ import annotations

import os


class StdinLines:
    """Lines from the node on fd 0, read without Python's buffering (so that the poller
    and the reader never disagree about what is waiting)."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self._buf = b""

    def read(self) -> list[bytes] | None:
        """The complete lines available now; None at EOF (the node is gone)."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        self._buf += data
        return self.buffered()

    def buffered(self) -> list[bytes]:
        """The complete lines already read from the fd. The read that brought the config
        may have brought the node's next commands too (a new generation sent while this
        process started): the poller will not report them again."""
        *lines, self._buf = self._buf.split(b"\n")
        return [line for line in lines if line.strip()]

    def first(self) -> bytes:
        """Block for the first line (the config); EOF before it raises EOFError."""
        while b"\n" not in self._buf:
            data = os.read(self.fd, 1 << 16)
            if not data:
                raise EOFError("the node closed stdin before sending the config")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line
