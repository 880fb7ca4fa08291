"""How a request or a model can fail, as the node says it (the API maps each to HTTP)."""

from __future__ import annotations

__all__ = ["ModelLoading", "RequestFailed"]


class RequestFailed(Exception):
    """A request ended without a result. ``code`` is stable; ``status`` is the HTTP one."""

    def __init__(self, code: str, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


class ModelLoading(Exception):
    """The model's instance exists but is not ready within the wait."""

    def __init__(self, model: str, detail: str) -> None:
        super().__init__(f"model {model!r} is loading: {detail}")
        self.model = model
        self.detail = detail
