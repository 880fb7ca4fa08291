"""Output to a reader that leaves early (``meshd config show | head``): no error.

When ``head`` has read its lines and exits, the next write to the pipe fails with
EPIPE; Python ignores SIGPIPE and raises BrokenPipeError instead, at that write or at
the interpreter's last flush, as a traceback. Both CLIs run their command through
:func:`reader_may_leave`, which ends quietly as ``cat`` would, with exit 0 (the output
the reader wanted was written). SIGPIPE is not restored to its default: ``meshd up``
talks over sockets, where a peer that leaves must never kill the node.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["reader_may_leave"]


def reader_may_leave(run: Callable[[], int]) -> int:
    """``run()``'s exit code, or 0 when stdout's reader left before the end."""
    try:
        code = run()
        sys.stdout.flush()  # what is still buffered fails here, not at the exit
        return code
    except BrokenPipeError:
        # stdout becomes /dev/null so the interpreter's last flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
