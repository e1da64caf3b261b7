"""The membership service: the coordinator that owns who is in every elastic group.

Layout:

- ``transitions`` — slot states and the transition table (`next_slot_state`), the
  pure failure/admission `decide` and each member's `local_action`, `ScalePhase`.
- ``registry`` — plain records of a group, its transition in flight, the deployment.
- ``scaling`` / ``status`` — pure scale plans and retirements, join checks, the
  `DeploymentStatus` view; ``operations`` — scale and retire operations by id (pure).
- ``service`` — `MembershipService`: handlers that take an event and return the
  messages to send (no sockets, no threads); ``supervisor_requests`` its supervisor half;
  ``handlers`` binds each handler to the request type it names.
- ``server`` — `Coordinator` / `start_coordinator`: the sockets, heartbeat clock and
  rendezvous TCPStore around the service (``python -m elasticep.membership.server``).
- ``process`` — `CoordinatorProcess`: the server as a child process of `serve` and
  `generate` (its own GIL; a lifeline pipe stops it, and it dies with its parent).
- ``messages`` (+ ``control_wire``) / ``protocol`` — the typed control messages, JSON lines.
- ``client`` — `CoordinatorClient`, the supervisors' (launcher, front-end, join) calls.
- ``durable_state`` / ``store`` / ``etcd_store`` / ``election`` / ``persister`` — the
  coordinator's durable state as JSON, the store seam (``--membership-store``), etcd's
  fenced commits and prefix claim, the leader lease, and the write-behind committer;
  ``directory`` the front-ends, replicas and rank processes announced in etcd, and
  ``lease_watch`` seeing their leases run out before etcd's sweep deletes their keys.
- ``errors`` — the typed errors of membership events and refusals.

It imports no other elasticep package; the rank-side torch backend
(``elasticep.distributed``) is built on top of it.
"""

from .client import CoordinatorClient
from .service import MembershipService, SendOnConn


def __getattr__(name: str):
    # Lazy (torch is imported there), and so `python -m elasticep.membership.server`
    # does not import the server module twice.
    if name in ("Coordinator", "start_coordinator"):
        from . import server

        return getattr(server, name)
    raise AttributeError(name)


__all__ = ["Coordinator", "CoordinatorClient", "MembershipService", "SendOnConn",
           "start_coordinator"]
