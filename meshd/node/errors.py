"""How a request or a model can fail, as the node says it (the API maps each to HTTP)."""

from __future__ import annotations

__all__ = ["ModelLoading", "RequestFailed"]


class RequestFailed(Exception):
    """A request ended without a result. ``code`` is stable; ``status`` is the HTTP one."""

    def __init__(
        self, code: str, message: str, status: int = 502, node: str = "", n_prompt: int = 0
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        #: The node at fault (``stage_fault``): a replay waits for a plan without it.
        self.node = node
        #: ``context_length_exceeded``: the prompt's tokens, as stage 0 counted them.
        self.n_prompt = n_prompt


class ModelLoading(Exception):
    """The model's instance exists but is not ready within the wait.

    ``fetching``: a stage still fetches its slice from the nodes that hold the model,
    said in words (``"31.2 of 49.1 MB at 20.5 MB/s"``); ``eta``: seconds that fetch
    still needs at its rate (0: unknown)."""

    def __init__(self, model: str, detail: str, fetching: str = "", eta: float = 0.0) -> None:
        super().__init__(f"model {model!r} is loading: {detail}")
        self.model = model
        self.detail = detail
        self.fetching = fetching
        self.eta = eta
