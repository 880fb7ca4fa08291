"""What the API needs from the node it runs on, and how a handler reaches it.

The node implements :class:`Services` (``meshd.node.services.NodeServices``); the
composition root (``meshd up``) builds the app with it. Handlers are plain functions of
a request: :func:`context` gives them the services, the settings and the admission
counter of their app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from starlette.requests import Request

from meshd.crdt.views import Instance, InstanceSpec
from meshd.domain.job import Job
from meshd.node.cluster import ClusterView
from meshd.node.diagnosis_facts import Report
from meshd.node.member_views import MemberView, PendingView
from meshd.node.metrics import Metrics
from meshd.node.services import Vitals
from meshd.transport import wire

from .limits import Admission
from .origins import AllowedHosts

__all__ = ["ApiContext", "ApiSettings", "Services", "context"]


class Services(Protocol):
    """The node's side of the API boundary."""

    metrics: Metrics

    @property
    def node_id(self) -> str: ...

    @property
    def cluster_name(self) -> str: ...

    @property
    def draining(self) -> bool:
        """The node is stopping: new requests go elsewhere (503 ``draining``)."""
        ...

    def view(self) -> ClusterView:
        """The cluster as of now."""
        ...

    def vitals(self) -> Vitals:
        """This node's own vitals (``GET /healthz``)."""
        ...

    async def changed(self, timeout: float) -> bool:
        """Until the cluster changes (True) or ``timeout`` seconds pass (False)."""
        ...

    def sync_metrics(self) -> None:
        """Bring gauges kept elsewhere into :attr:`metrics` (before a scrape)."""
        ...

    async def instance_for(self, model: str, context: int = 0) -> Instance:
        """The ready instance serving ``model``, placing one if needed (with ``context``
        tokens a request; 0: the default), with a bounded wait."""
        ...

    async def place(
        self, spec: InstanceSpec, replicas: int = 1, keep: bool = False
    ) -> list[Instance]:
        """Place ``replicas`` instances as asked (each on nodes of its own), in place of
        the model's automatic instance unless ``keep``."""
        ...

    def remove(self, instance_id: str) -> bool:
        """Delete an instance; False if there is none with that id."""
        ...

    def instance_load(self) -> Mapping[str, int]:
        """Requests this node's API runs on each instance now, by instance id."""
        ...

    def members(self) -> tuple[list[MemberView], list[PendingView]]:
        """The members, and the nodes waiting for approval here (NotSecured: open)."""
        ...

    def approve(self, code: str, node: str = "") -> list[PendingView]:
        """Approve the waiting node that shows ``code`` (LookupError: none does)."""
        ...

    def invite(self) -> tuple[str, float]:
        """A pairing code and the seconds it stays good."""
        ...

    def remove_member(self, ref: str) -> MemberView:
        """Remove a member for good (id or name); LookupError if none, ``NotOwner``
        if this node may not."""
        ...

    def generate(
        self,
        inst: Instance,
        job: Job,
        keep_alive: float | None = None,
    ) -> AsyncIterator[wire.DataChunk]:
        """Run one request on ``inst``: its chunks, the first one the acknowledgement;
        then keep the instance loaded ``keep_alive`` seconds (None: the default)."""
        ...

    def keep_alive(self, instance_id: str, seconds: float | None) -> None:
        """Keep ``instance_id`` loaded ``seconds`` from now (None: the node's default;
        0: unload it once no request runs on it)."""
        ...

    async def doctor(self) -> Report:
        """What is wrong here and the fix for each (``GET /v1/doctor``): facts the node
        observed and its peers' ports probed from here (bounded, about 1.5 s)."""
        ...


@dataclass(frozen=True)
class ApiSettings:
    """What ``meshd up`` was told about its API (defaults live in ``NodeConfig``)."""

    #: The key inference and reading demand (Bearer or ``x-api-key``); None serves
    #: anyone. It never opens an admin route (``auth.py``).
    api_key: str | None
    #: The key remote administration sends in ``x-meshd-admin``; None: none.
    admin_key: str | None
    #: The owner's token (``owner.token`` in the data dir), taken from loopback only.
    owner_token: str | None
    #: Completion requests in flight through this node; more get 429.
    max_requests: int
    #: Most tokens one request may generate (``max_tokens`` above it is a 400).
    max_tokens: int
    #: Names a request's Host (and a browser's Origin) may carry (see ``origins.py``).
    hosts: AllowedHosts


@dataclass
class ApiContext:
    """Everything a handler of one app works with."""

    services: Services
    settings: ApiSettings
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings.max_requests)


def context(request: Request) -> ApiContext:
    """The context of the app that took ``request``."""
    ctx: ApiContext = request.app.state.ctx
    return ctx
