"""A rank's links to several front-ends: one :class:`WorkerChannel` per front-end, with
the same calls as one, so the step loops need not know how many there are.

Each front-end sends its own requests; the rank remembers which link a request came on
and sends its outputs, errors and step failures back on that link only. Hellos and
counters go to every link. The set of front-ends comes from ``directory`` (a call that
lists them; under ``--membership-store etcd://`` it reads the front-ends' leased keys,
:mod:`elasticep.membership.directory`), re-read every ``refresh_s`` on a thread
of its own, so a slow etcd never delays a step. A front-end that leaves the list (it
died, its lease ran out) has its link closed without a flush and its requests aborted
on this rank, which serves the other front-ends' requests on as before.

Request ids are the front-ends' (random, ``uuid4``); a request whose id is already in
flight here from another front-end is refused on its own link (``RequestError``), so
ids never mix across front-ends.

A front-end process that dies may be relaunched on the same link addresses before the
directory notices (``serve --api-server-count``), so the link alone does not tell its
requests from its successor's: each request is also tagged with the origin id of the
channel that sent it (one per process incarnation, :class:`~.channels.FrontendChannel`).
An :class:`~.messages.AbortOrigin` on any link aborts that origin's requests here and
refuses the ones still on their way, whichever link they arrive on; the successor's
requests carry another id and are never touched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq

from elasticep.engine.request import AbortRequest, TokenOutput

from . import messages as m
from .channels import FrontendUnreachableError, WorkerChannel

logger = logging.getLogger(__name__)

# The front-ends now, or None while that is unknown (etcd out of reach).
Directory = Callable[[], "Sequence[m.LinkEndpoints] | None"]

# Dead origins remembered, to refuse their requests still on the way; only the last few
# deaths can have any (a dead process sends nothing new).
DEAD_ORIGINS_KEPT = 64


class FrontendLinks:
    """Worker side over every front-end of the deployment; see the module docstring.

    Args:
        first: the front-end named in the deployment config (node 0's), linked at once.
        rank, epoch, send_timeout_s, limits, moe_a2a_backend: as for
            :class:`WorkerChannel`, for every link.
        directory: lists the front-ends; an empty list counts as unknown (links are
            dropped only when the list names others).
        refresh_s: how often ``directory`` is read (seconds).
        hello_every_s: say hello on every link this often (seconds; None: only at
            start and on a new link). A front-end process relaunched on the same link
            addresses reconnects without the rank noticing; only a hello lets it route
            to the rank again.
    """

    def __init__(self, first: m.LinkEndpoints, rank: int, directory: Directory,
                 epoch: int = 0, send_timeout_s: float = 5.0,
                 limits: tuple[int, int] | None = None,
                 moe_a2a_backend: str | None = None, refresh_s: float = 0.25,
                 hello_every_s: float | None = None) -> None:
        self.rank = rank
        self._hello_every_s = hello_every_s
        self._last_hello = time.monotonic()
        self._epoch = epoch
        self.limits = limits
        self.moe_a2a_backend = moe_a2a_backend
        self._send_timeout_s = send_timeout_s
        self._links: dict[str, WorkerChannel] = {}  # by request address
        # request id -> (its link's request address, its sender's origin id)
        self._origin: dict[str, tuple[str, str]] = {}
        self._dead: OrderedDict[str, None] = OrderedDict()  # aborted origin ids, oldest first
        self._listed: list[m.LinkEndpoints] | None = None  # the thread's latest read
        self._pending_aborts: list[AbortRequest] = []
        self._open(first)
        self._directory = directory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(refresh_s,), daemon=True,
                                        name="frontend-directory")
        self._thread.start()

    # ---- the set of links ------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The membership epoch outputs are tagged with (set by the step loop)."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = value
        for link in self._links.values():
            link.epoch = value

    @property
    def frontends(self) -> list[str]:
        """The request addresses of the front-ends this rank is linked to."""
        return sorted(self._links)

    def _open(self, endpoints: m.LinkEndpoints) -> WorkerChannel:
        link = WorkerChannel(endpoints, self.rank, self._epoch, self._send_timeout_s,
                             self.limits, self.moe_a2a_backend)
        self._links[endpoints.request_addr] = link
        return link

    def _watch(self, refresh_s: float) -> None:
        while not self._stop.wait(refresh_s):
            try:
                listed = self._directory()
            except Exception as exc:  # noqa: BLE001 - an unreadable directory changes nothing
                logger.debug("rank %d: front-end directory unreadable: %r", self.rank, exc)
                continue
            if listed:
                self._listed = list(listed)

    def _apply_directory(self) -> None:
        """Link to new front-ends (with a hello) and drop the ones no longer listed;
        runs on the step loop's thread, which owns the sockets."""
        listed, self._listed = self._listed, None
        if listed is None:
            return
        wanted = {e.request_addr: e for e in listed}
        for addr in [a for a in self._links if a not in wanted]:
            self._drop(addr, "it left the front-end directory")
        for addr, endpoints in wanted.items():
            if addr not in self._links:
                logger.info("rank %d: linking to the front-end at %s", self.rank, addr)
                try:
                    self._open(endpoints).hello()
                except FrontendUnreachableError as exc:
                    logger.warning("rank %d: %s", self.rank, exc)

    def _drop(self, addr: str, why: str) -> None:
        """Close one link without a flush and abort its requests here."""
        link = self._links.pop(addr)
        link.close(flush=False)
        mine = self._forget(lambda a, _: a == addr)
        logger.warning("rank %d: dropped the front-end at %s (%s); aborting its %d "
                       "requests here", self.rank, addr, why, len(mine))

    def _forget(self, which: Callable[[str, str], bool]) -> list[str]:
        """Abort (at the next :meth:`poll`) every request whose (link address, origin
        id) ``which`` picks; returns their ids."""
        mine = [rid for rid, (addr, origin) in self._origin.items() if which(addr, origin)]
        for rid in mine:
            del self._origin[rid]
        self._pending_aborts += [AbortRequest(rid) for rid in mine]
        return mine

    def _abort_origin(self, origin_id: str) -> None:
        """A front-end process is gone: abort its requests and refuse its late ones."""
        self._dead[origin_id] = None
        while len(self._dead) > DEAD_ORIGINS_KEPT:
            self._dead.popitem(last=False)
        mine = self._forget(lambda _, origin: origin == origin_id)
        logger.warning("rank %d: front-end process %s is gone; aborting its %d requests "
                       "here", self.rank, origin_id, len(mine))

    # ---- the WorkerChannel calls ------------------------------------------------------
    def hello(self) -> None:
        """Announce this rank on every link (see :meth:`WorkerChannel.hello`).

        Raises:
            FrontendUnreachableError: no link took the hello.
        """
        errors = []
        for link in self._links.values():
            try:
                link.hello()
            except FrontendUnreachableError as exc:
                errors.append(exc)
        self._last_hello = time.monotonic()
        if errors and len(errors) == len(self._links):
            raise errors[0]

    def poll(self, timeout_s: float) -> list[m.RankMessage]:
        """Wait up to ``timeout_s`` seconds for requests and aborts on any link; also
        returns an abort for each request of a front-end dropped (or named by an
        :class:`~.messages.AbortOrigin`) since the last call."""
        self._apply_directory()
        if (self._hello_every_s is not None
                and time.monotonic() - self._last_hello >= self._hello_every_s):
            try:
                self.hello()
            except FrontendUnreachableError as exc:  # every queue full: next time
                logger.debug("rank %d: %s", self.rank, exc)
        out: list[m.RankMessage] = list(self._pending_aborts)
        self._pending_aborts = []
        poller = zmq.Poller()
        for link in self._links.values():
            poller.register(link.request_socket, zmq.POLLIN)
        if not poller.poll(timeout=0 if out else max(0, int(timeout_s * 1000))):
            return out
        for addr, link in list(self._links.items()):
            for origin_id, msg in link.receive(0):
                if isinstance(msg, m.AbortOrigin):
                    self._abort_origin(msg.origin_id)
                elif self._accept(addr, origin_id, link, msg):
                    out.append(msg)
        # after the requests read with them: an origin's request read before its
        # AbortOrigin is added, then aborted
        out += self._pending_aborts
        self._pending_aborts = []
        return out

    def _accept(self, addr: str, origin_id: str, link: WorkerChannel,
                msg: m.RankMessage) -> bool:
        """Record where ``msg`` came from; False if it is refused here."""
        rid = msg.request_id
        if isinstance(msg, AbortRequest):
            if self._origin.get(rid) == (addr, origin_id):  # the front-end is done with it
                del self._origin[rid]
                return True
            return False  # another front-end's request: not this one's to abort
        if origin_id in self._dead:  # sent just before its process died
            logger.info("rank %d: dropping request %s of the gone front-end process %s",
                        self.rank, rid, origin_id)
            return False
        held = self._origin.get(rid)
        if held is not None and held[0] != addr:
            link.send_error(rid, f"request id {rid} is in flight from another front-end")
            return False
        self._origin[rid] = (addr, origin_id)
        return True

    def _link_of(self, request_id: str, final: bool) -> tuple[str, WorkerChannel] | None:
        held = self._origin.pop(request_id, None) if final else self._origin.get(request_id)
        if held is None or held[0] not in self._links:
            return None
        return held[0], self._links[held[0]]

    def _send(self, addr: str, send: Callable[[WorkerChannel], None]) -> None:
        """``send`` on one link; a link that cannot take it is dropped if others are
        left (a front-end gone before its lease ran out), else the error propagates."""
        link = self._links.get(addr)
        if link is None:
            return
        try:
            send(link)
        except FrontendUnreachableError as exc:
            if len(self._links) == 1:
                raise
            self._drop(addr, str(exc))

    def send_outputs(self, outputs: Sequence[TokenOutput], epoch: int | None = None,
                     first_tokens: Sequence[m.FirstTokenTimes] = ()) -> None:
        """:meth:`WorkerChannel.send_outputs`, each output on its request's link;
        outputs of requests with no link (their front-end was dropped) are dropped."""
        by_link: dict[str, list[TokenOutput]] = {}
        for out in outputs:
            found = self._link_of(out.request_id, final=out.finish_reason is not None)
            if found is not None:
                by_link.setdefault(found[0], []).append(out)
        firsts: dict[str, list[m.FirstTokenTimes]] = {}
        for times in first_tokens:
            addr = next((a for a, outs in by_link.items()
                         if any(o.request_id == times.request_id for o in outs)), None)
            if addr is not None:
                firsts.setdefault(addr, []).append(times)
        for addr, outs in by_link.items():
            self._send(addr, lambda link, outs=outs, addr=addr: link.send_outputs(
                outs, epoch, firsts.get(addr, ())))

    def send_stats(self, *args: int, **kwargs: int) -> None:
        """:meth:`WorkerChannel.send_stats` on every link."""
        for addr in list(self._links):
            self._send(addr, lambda link: link.send_stats(*args, **kwargs))

    def send_error(self, request_id: str, message: str) -> None:
        """:meth:`WorkerChannel.send_error` on the request's link."""
        found = self._link_of(request_id, final=True)
        if found is not None:
            self._send(found[0], lambda link: link.send_error(request_id, message))

    def send_step_failed(self, request_ids: Sequence[str], message: str) -> None:
        """:meth:`WorkerChannel.send_step_failed`, each link told of its requests."""
        by_link: dict[str, list[str]] = {}
        for rid in request_ids:
            found = self._link_of(rid, final=False)
            if found is not None:
                by_link.setdefault(found[0], []).append(rid)
        for addr, rids in by_link.items():
            self._send(addr, lambda link, rids=rids: link.send_step_failed(rids, message))

    def close(self) -> None:
        """Stop reading the directory and close every link (outputs get up to 1 s each
        to flush)."""
        self._stop.set()
        for link in self._links.values():
            link.close()
        self._links = {}


# How often a rank says hello again on each of its links (seconds).
HELLO_EVERY_S = 1.0


def worker_link(endpoints: m.LinkEndpoints, rank: int, membership_store: str, epoch: int = 0,
                limits: tuple[int, int] | None = None,
                moe_a2a_backend: str | None = None,
                extra: Sequence[m.LinkEndpoints] = ()) -> WorkerChannel | FrontendLinks:
    """A rank's link to the front-ends: with an etcd ``membership_store`` (every node
    serves the API) one link per announced front-end (:class:`FrontendLinks`); else the
    link to ``endpoints`` (node 0's front-end) and to each of ``extra`` (its other
    front-end processes, ``serve --api-server-count``), a fixed set."""
    if not membership_store.startswith("etcd://"):
        if not extra:
            return WorkerChannel(endpoints, rank, epoch, limits=limits,
                                 moe_a2a_backend=moe_a2a_backend)
        return static_links([endpoints, *extra], rank, epoch, limits, moe_a2a_backend)
    from elasticep.membership.directory import directory_reader  # etcd if asked

    read = directory_reader(membership_store)

    def directory() -> list[m.LinkEndpoints]:
        return [m.LinkEndpoints(str(v["request_addr"]), str(v["output_addr"]))
                for v in read().values() if "request_addr" in v and "output_addr" in v]

    # a front-end process relaunched on its old link addresses stays listed: only a
    # hello tells it of this rank
    return FrontendLinks(endpoints, rank, directory, epoch, limits=limits,
                         moe_a2a_backend=moe_a2a_backend, hello_every_s=HELLO_EVERY_S)


def static_links(endpoints: Sequence[m.LinkEndpoints], rank: int, epoch: int = 0,
                 limits: tuple[int, int] | None = None,
                 moe_a2a_backend: str | None = None) -> FrontendLinks:
    """Links to a fixed set of front-ends (one node's front-end processes), with a
    hello every :data:`HELLO_EVERY_S` so that a process relaunched on its old
    link addresses is told of this rank again."""
    fixed = list(endpoints)
    return FrontendLinks(fixed[0], rank, lambda: fixed, epoch, limits=limits,
                         moe_a2a_backend=moe_a2a_backend,
                         hello_every_s=HELLO_EVERY_S)


def extra_endpoints(request_addrs: Sequence[str],
                    output_addrs: Sequence[str]) -> list[m.LinkEndpoints]:
    """The deployment config's extra front-end links, paired.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(request_addrs) != len(output_addrs):
        raise ValueError(f"{len(request_addrs)} extra front-end request addresses but "
                         f"{len(output_addrs)} output addresses")
    return [m.LinkEndpoints(r, o) for r, o in zip(request_addrs, output_addrs, strict=True)]
