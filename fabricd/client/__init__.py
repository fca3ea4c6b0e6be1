"""The client library: what a training process imports to talk to its node's daemon.

>>> import fabricd
>>> with fabricd.connect(job="demo") as fab:           # rank/size also from RANK/WORLD_SIZE
...     g = fab.array("grad", (1024,), "float32")      # numpy view of a shared-memory segment
...     fab.send(g, to=1)                              # or fab.recv(g, src=1)

Arrays live in sealed memfd segments (:mod:`fabricd.shm`) that the daemon maps too, so a send
or receive passes only (segment, offset, length, dtype) over the socket; the daemon reads and
writes the array's memory directly.

Layers, one module each:

* :mod:`~fabricd.client.protocol`: the client socket's rules, sans-IO (bytes in; replies and
  events out);
* :mod:`~fabricd.client.connection`: the socket, SCM_RIGHTS, and the hand-off between threads;
* :mod:`~fabricd.client.arrays`: the shared-memory arrays of ``fab.array()``;
* one facet per engine of the daemon, reached through :class:`Client`:
  :mod:`~fabricd.client.p2p` (``fab.p2p``; ``fab.send`` and ``fab.recv`` are its shortcuts) and
  :mod:`~fabricd.client.collectives` (``fab.collectives``; ``fab.allreduce``, ``fab.broadcast``,
  ``fab.barrier`` and ``fab.sync_model`` are its shortcuts) and
  :mod:`~fabricd.client.stochastic` (``fab.stochastic``; ``fab.stochastic_reduce`` is its
  shortcut) and :mod:`~fabricd.client.ps` (``fab.parameter_server()`` opens a model);
  every shortcut has the signature of the facet's method, and every call that waits has an
  ``_async`` form that returns a :class:`Handle` instead;
* :mod:`~fabricd.client.checks`: every argument is checked before anything is sent.

The client is synchronous and thread-safe, with no thread of its own: one waiting thread at a
time reads from the socket and completes whichever handles the replies belong to, while the
others wait to be told; sends never wait behind a read.

Events: the daemon may push news (EVENT frames, docs/protocol.md §4) at any moment.  Whichever
thread is reading queues them; :meth:`Client.poll` returns them (and reads what has arrived).
The last one a connection gets may be ``closing``: the daemon's reason for hanging up, which
is also what every pending call then raises.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Literal

from fabricd.client import checks
from fabricd.client.ako import FlushResult, PartialExchange, PartialExchanges, StepResult
from fabricd.client.arrays import SharedArrays
from fabricd.client.collectives import AllreduceAlgorithm, Collectives, Late, Mode, Op, Result
from fabricd.client.connection import Connection
from fabricd.client.handle import Handle
from fabricd.client.p2p import Completion, PointToPoint, Wait
from fabricd.client.protocol import Event
from fabricd.client.ps import ParameterServer, PushResult, open_request
from fabricd.client.stochastic import ReduceResult, StochasticReduce, Sync
from fabricd.engines.ps.bounded import DivergenceBound
from fabricd.engines.ps.filters import FilterSettings
from fabricd.errors import DaemonUnavailable, Timeout, UsageError
from fabricd.ipc import socket_candidates
from fabricd.slurm import task_identity

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from types import TracebackType

    import numpy as np

    from fabricd.wire import Meta

__all__ = [
    "Client",
    "Completion",
    "DivergenceBound",
    "Event",
    "FilterSettings",
    "FlushResult",
    "Handle",
    "ParameterServer",
    "PartialExchange",
    "PushResult",
    "ReduceResult",
    "Result",
    "StepResult",
    "connect",
]


class Client:
    """A connection to the local daemon.  Make one with :func:`connect`.

    Attributes:
        socket_path: the socket it is connected to.
        job: the job it joined, or ``None`` for a control client (status, config only).
        node, nodes: this daemon's node id and the number of nodes of the fabric.
        p2p: the point-to-point facet (send, recv and their ``_async`` forms).
        collectives: the collectives facet (allreduce, broadcast, barrier, sync_model and
            their ``_async`` forms).
        stochastic: the stochastic-reduce facet (stochastic_reduce over a communication graph, and
            its ``_async`` form).
        ako: the partial-exchange facet (Ako's partial gradient exchange).
    """

    def __init__(
        self, connection: Connection, job: checks.Membership | None, timeout: float
    ) -> None:
        self.socket_path = connection.path
        self.job = job.job if job is not None else None
        self._connection = connection
        self._membership = job
        fields: dict[str, Any] = {"pid": os.getpid()}
        if job is not None:
            fields.update(job=job.job, rank=job.rank, size=job.size)
        try:
            hello = self._call("hello", timeout=timeout, **fields)
        except DaemonUnavailable as exc:
            connection.close()
            if connection.closing is not None:  # the daemon said why: that is the error
                raise
            raise DaemonUnavailable(
                f"{exc}. It hung up without saying why, so the reason is in its log, under this "
                f"pid ({os.getpid()}): it may have been stopped or killed, or (a daemon that "
                "refuses without a word) not admit this process, whose uid "
                f"{os.getuid()} and groups must be in its allowed_uids/allowed_gids, or already "
                "serve max_clients clients"
            ) from None
        except BaseException:
            connection.close()
            raise
        self.node: int = hello["node"]
        self.nodes: int = hello["nodes"]
        self._arrays = SharedArrays(connection)
        self.p2p = PointToPoint(connection, self._arrays, job)
        self.collectives = Collectives(connection, self._arrays, job)
        self.stochastic = StochasticReduce(connection, self._arrays, job)
        self.ako = PartialExchanges(connection, self._arrays, job)
        self._servers: dict[str, ParameterServer] = {}  #: models with an update callback

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        return self._joined().rank

    @property
    def size(self) -> int:
        """The number of ranks in the job."""
        return self._joined().size

    def _joined(self) -> checks.Membership:
        if self._membership is None:
            raise UsageError("this client joined no job; pass job= to fabricd.connect()")
        return self._membership

    # -- arrays -----------------------------------------------------------------------------
    def array(
        self, name: str, shape: int | Sequence[int], dtype: Any = "float32"
    ) -> np.ndarray[Any, Any]:
        """A zero-filled numpy array in shared memory that the daemon can move directly.

        Asking again for the same name returns the same array (shape and dtype must agree).
        ``dtype`` is a numpy dtype or its name; ``"bfloat16"`` (or ``ml_dtypes.bfloat16``)
        gives an array of ``ml_dtypes.bfloat16``, the numpy bfloat16 that JAX uses, so a
        JAX array copies in with ``a[:] = np.asarray(x)`` and numpy arithmetic on it is
        bfloat16 arithmetic.  (Not 16-bit words with a separate ``dtype=``: on a ``uint16``
        array ``g += 1`` would silently add to the bits, and every call would need to repeat
        the type.)  A torch tensor over it: ``fabricd.torch.tensor_of(a)`` (torch's
        ``from_numpy`` does not take it).

        Raises:
            UsageError: a name that is not a non-empty str, a shape that is not ints >= 0, a
                dtype not in :mod:`fabricd.dtypes`, or a name reused with another layout.
            OperationFailed: code ``limit``: the array would take this client or the daemon
                past a cap on segments or mapped bytes; the message names the setting
                (``max_segments_per_client``, ``max_mapped_bytes_per_client``,
                ``max_segments``, ``max_mapped_bytes``).  Code ``resources``: the daemon could
                not map it (out of memory, address space or fds).  Nothing was attached.
        """
        return self._arrays.create(name, shape, dtype)

    # -- point to point (shortcuts to the p2p facet) ----------------------------------------
    def send(
        self,
        array: np.ndarray[Any, Any],
        to: int,
        tag: int = 0,
        *,
        timeout: float | None = None,
        wait: Wait = "delivered",
    ) -> Completion:
        """Send ``array`` to rank ``to``; returns once the receiver has all of it, or with
        ``wait="sent"`` once ``array`` may change again (:meth:`PointToPoint.send`)."""
        return self.p2p.send(array, to, tag, timeout=timeout, wait=wait)

    def recv(
        self, array: np.ndarray[Any, Any], src: int, tag: int = 0, *, timeout: float | None = None
    ) -> Completion:
        """Receive from rank ``src`` into ``array`` (same byte size and dtype as sent)."""
        return self.p2p.recv(array, src, tag, timeout=timeout)

    def send_async(
        self, array: np.ndarray[Any, Any], to: int, tag: int = 0, *, wait: Wait = "delivered"
    ) -> Handle[Completion]:
        """Start a send; leave ``array`` unchanged until the handle is done."""
        return self.p2p.send_async(array, to, tag, wait=wait)

    def recv_async(self, array: np.ndarray[Any, Any], src: int, tag: int = 0) -> Handle[Completion]:
        """Start a receive; don't read ``array`` until the handle is done."""
        return self.p2p.recv_async(array, src, tag)

    # -- collectives (shortcuts to the collectives facet) -----------------------------------
    def allreduce(
        self,
        array: np.ndarray[Any, Any],
        op: Op = "sum",
        mode: Mode = "sync",
        *,
        name: str | None = None,
        timeout: float | None = None,
        late: Late = "sum",
        algorithm: AllreduceAlgorithm = "auto",
    ) -> Result:
        """Reduce ``array`` over the job's ranks in place (:meth:`Collectives.allreduce`);
        ``mode``: ``"sync"``, ``"solo"`` or ``"majority"``; ``late``: what a partial call
        gets when its rank missed rounds; ``algorithm``: ``"auto"``, ``"ring"``,
        ``"doubling"``, ``"tree"`` or ``"mlfabric"``."""
        return self.collectives.allreduce(
            array, op, mode, name=name, timeout=timeout, late=late, algorithm=algorithm
        )

    def allreduce_async(
        self,
        array: np.ndarray[Any, Any],
        op: Op = "sum",
        mode: Mode = "sync",
        *,
        name: str | None = None,
        late: Late = "sum",
        algorithm: AllreduceAlgorithm = "auto",
    ) -> Handle[Result]:
        """Start an allreduce; ``.wait(timeout=)`` for its :class:`Result`."""
        return self.collectives.allreduce_async(
            array, op, mode, name=name, late=late, algorithm=algorithm
        )

    def broadcast(
        self,
        array: np.ndarray[Any, Any],
        root: int = 0,
        *,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        """Copy rank ``root``'s ``array`` into every rank's (:meth:`Collectives.broadcast`)."""
        return self.collectives.broadcast(array, root, name=name, timeout=timeout)

    def broadcast_async(
        self, array: np.ndarray[Any, Any], root: int = 0, *, name: str | None = None
    ) -> Handle[Result]:
        """Start a broadcast; leave ``array`` alone until ``.wait(timeout=)`` returns its
        :class:`Result`."""
        return self.collectives.broadcast_async(array, root, name=name)

    def allgather(
        self,
        input: np.ndarray[Any, Any],
        output: np.ndarray[Any, Any],
        *,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        """Every rank's ``input`` (``k`` elements) into every rank's ``output`` (``size * k``,
        rank ``r``'s at ``r * k``) (:meth:`Collectives.allgather`)."""
        return self.collectives.allgather(input, output, name=name, timeout=timeout)

    def allgather_async(
        self, input: np.ndarray[Any, Any], output: np.ndarray[Any, Any], *, name: str | None = None
    ) -> Handle[Result]:
        """Start an allgather; ``.wait(timeout=)`` for its :class:`Result`."""
        return self.collectives.allgather_async(input, output, name=name)

    def reduce_scatter(
        self,
        input: np.ndarray[Any, Any],
        output: np.ndarray[Any, Any],
        op: Op = "sum",
        *,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        """Rank ``r``'s ``output`` (``k`` elements) gets ``op`` over every rank's block ``r``
        of ``input`` (``size * k``) (:meth:`Collectives.reduce_scatter`)."""
        return self.collectives.reduce_scatter(input, output, op, name=name, timeout=timeout)

    def reduce_scatter_async(
        self,
        input: np.ndarray[Any, Any],
        output: np.ndarray[Any, Any],
        op: Op = "sum",
        *,
        name: str | None = None,
    ) -> Handle[Result]:
        """Start a reduce-scatter; ``.wait(timeout=)`` for its :class:`Result`."""
        return self.collectives.reduce_scatter_async(input, output, op, name=name)

    def barrier(self, *, name: str = "barrier", timeout: float | None = None) -> Result:
        """Wait until every rank of the job reached this barrier."""
        return self.collectives.barrier(name=name, timeout=timeout)

    def barrier_async(self, *, name: str = "barrier") -> Handle[Result]:
        """Enter the barrier; ``.wait(timeout=)`` returns once every rank entered it."""
        return self.collectives.barrier_async(name=name)

    def sync_model(
        self,
        array: np.ndarray[Any, Any],
        *,
        every: int = 1,
        root: int | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result | None:
        """Average (or, with ``root``, broadcast) the model every ``every``-th call
        (:meth:`Collectives.sync_model`, eager-SGD §5)."""
        return self.collectives.sync_model(
            array, every=every, root=root, name=name, timeout=timeout
        )

    def sync_model_async(
        self,
        array: np.ndarray[Any, Any],
        *,
        every: int = 1,
        root: int | None = None,
        name: str | None = None,
    ) -> Handle[Result] | None:
        """Count a :meth:`sync_model` call and start the synchronisation on every
        ``every``-th: ``None`` on the others (:meth:`Collectives.sync_model_async`)."""
        return self.collectives.sync_model_async(array, every=every, root=root, name=name)

    def interrupted_collectives(self) -> dict[str, Handle[Result]]:
        """Collective calls a blocking method stopped waiting for (Ctrl-C, a timeout) that are
        still under way, by name: kept, not withdrawn
        (:meth:`Collectives.interrupted_collectives`)."""
        return self.collectives.interrupted_collectives()

    # -- partial gradient exchange (shortcut to the exchanges facet) ---------------------------
    def partial_exchange(
        self,
        name: str,
        model: np.ndarray[Any, Any],
        *,
        partitions: int | Literal["auto"] = "auto",
        lr: float,
        staleness: int = 0,
        timeout: float | None = None,
    ) -> PartialExchange:
        """Open Ako's partial gradient exchange ``name`` of ``model`` between the job's ranks
        (:meth:`PartialExchanges.partial_exchange`, Ako §3-§4)."""
        return self.ako.partial_exchange(
            name, model, partitions=partitions, lr=lr, staleness=staleness, timeout=timeout
        )

    # -- stochastic reduce (shortcut to the stochastic facet) -----------------------------------
    def stochastic_reduce(
        self,
        array: np.ndarray[Any, Any],
        graph: str = "expander",
        sync: Sync = "notify-ack",
        *,
        degree: int | None = None,
        seed: int = 0,
        edges: Iterable[tuple[int, int]] | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> ReduceResult:
        """Average ``array`` in place with its in-neighbours' models in ``graph``
        (:meth:`StochasticReduce.stochastic_reduce`, ASAP §3-§4)."""
        return self.stochastic.stochastic_reduce(
            array,
            graph,
            sync,
            degree=degree,
            seed=seed,
            edges=edges,
            name=name,
            timeout=timeout,
        )

    def stochastic_reduce_async(
        self,
        array: np.ndarray[Any, Any],
        graph: str = "expander",
        sync: Sync = "notify-ack",
        *,
        degree: int | None = None,
        seed: int = 0,
        edges: Iterable[tuple[int, int]] | None = None,
        name: str | None = None,
    ) -> Handle[ReduceResult]:
        """Start a stochastic reduce; leave ``array`` alone until ``.wait(timeout=)`` returns
        its :class:`ReduceResult`."""
        return self.stochastic.stochastic_reduce_async(
            array, graph, sync, degree=degree, seed=seed, edges=edges, name=name
        )

    # -- parameter server -------------------------------------------------------------------
    def parameter_server(
        self,
        name: str,
        shape: int | Sequence[int],
        dtype: Any = "float32",
        role: str = "worker",
        *,
        servers: Sequence[int] = (0,),
        replicas: Sequence[int] = (),
        consistency: str = "async",
        staleness: int = 0,
        delay_bound: int | None = None,
        update_rule: Any = "sum",
        lr: float | None = None,
        momentum: float | None = None,
        lr_delay: str | None = None,
        lr_t0: float | None = None,
        filters: FilterSettings | None = None,
        chunk: int = 1,
        seed: int = 0,
        initial: np.ndarray[Any, Any] | None = None,
        timeout: float | None = 30.0,
        scheduling: str = "arrival",
        aggregation: bool = False,
        replication: str = "chain",
        divergence_bound: float | DivergenceBound | None = None,
        distribution: str = "direct",
    ) -> ParameterServer:
        """Open parameter-server model ``name`` as a ``"worker"``, ``"server"`` or
        ``"replica"`` of it (:mod:`fabricd.client.ps`; MLfabric §2, Table 1; TDF §III).

        ``servers``: the server ranks, one per key-range shard; ``replicas``: none, or one
        rank per server that takes over if it dies.  ``update_rule``: ``"sum"``, ``"sgd"``
        (``lr``, ``momentum``; ``lr_delay="adaptive"``: each update's step size is
        ``lr sqrt(lr_t0 / (lr_t0 + t + tau))``, AdaDelay, MLfabric §3.1, §10.4) or a callable
        ``f(model, update)`` that steps ``model`` in place in the server's own process, run
        while it is in :meth:`ParameterServer.serve` (MLfabric's registerUpdateCallback;
        replicas pass the same one).  ``initial`` (servers and replicas: the same on each):
        the starting model, a ``fab.array()``; zeros if omitted.  ``filters``: TDF's filters
        (:class:`FilterSettings`, all off by default); ``seed`` seeds G-RP.
        ``scheduling``: ``"arrival"`` (pushes applied as they come) or ``"mlfabric"``
        (async or bsp: each push waits for the shard's scheduler; under async it orders a
        batch of them shortest transfer first with τmax deadlines and drops what cannot make
        its deadline before it is sent, MLfabric-A of §5.1; under bsp it paces an iteration's
        pushes in the order they became ready and drops none, MLfabric-S of §6;
        docs/mlfabric.md).  ``aggregation`` (with
        ``"mlfabric"``): the scheduler may have groups of pushes summed at worker daemons and
        sent to the server as one (MLfabric §5.2, Alg. 3).  ``replication`` (with
        ``replicas``): ``"chain"`` (the default: a server applies a push only once its
        replica logged it, so a failover loses nothing acknowledged) or ``"bounded"`` (async
        only: workers send their replica copies themselves and the server leads its replica
        by at most ``divergence_bound``, a norm ``Div_max`` on ``||w_server - w_replica||``
        or a :class:`DivergenceBound` of a norm and/or a count of updates; a failover may roll
        the model back that far, and says so: MLfabric §3.3, §5.3, docs/mlfabric.md).
        ``distribution`` (with ``"mlfabric"``): ``"direct"`` (the server answers every pull)
        or ``"tree"`` (pulls are batched per scheduling interval, answered at one version,
        and some pullers' daemons forward the answer to others, so the server's link sends
        the model fewer times: MLfabric §10.3's distribution trees, docs/mlfabric.md).

        Raises:
            UsageError: a bad argument, a rank whose role does not match ``servers`` and
                ``replicas``, or a spec unlike the one this model was opened with.
            OperationFailed: code ``limit``: a shard larger than ``max_payload``.
        """
        dims = checks.shape(shape)
        if not dims or 0 in dims:
            raise UsageError(f"a parameter server's shape has dimensions > 0, not {dims}")
        dt = checks.dtype(dtype)
        fields = open_request(
            name=name,
            shape=dims,
            dtype=dt,
            role=role,
            servers=servers,
            replicas=replicas,
            consistency=consistency,
            staleness=staleness,
            delay_bound=delay_bound,
            update_rule=update_rule,
            lr=lr,
            momentum=momentum,
            lr_delay=lr_delay,
            lr_t0=lr_t0,
            filters=filters,
            chunk=chunk,
            seed=seed,
            scheduling=scheduling,
            aggregation=aggregation,
            replication=replication,
            divergence_bound=divergence_bound,
            distribution=distribution,
        )
        if initial is not None:
            if role == "worker":
                raise UsageError("initial= is for servers and replicas: workers pull the model")
            if initial.dtype != dt or initial.size != fields["size"]:
                raise UsageError(f"initial must hold {fields['size']} elements of {dt}")
            seg, offset = self._arrays.locate(initial)
            fields.update(seg=seg, off=offset, nbytes=initial.nbytes)
        step = None
        if callable(update_rule):
            step = self._step_buffer(fields, role, ranks=(servers, replicas), dtype=dt)
        reply = self._call("ps_open", timeout=timeout, **fields)
        return ParameterServer(
            self._connection,
            self._arrays,
            name=name,
            role=role,  # type: ignore[arg-type]
            shape=dims,
            dtype=dt,
            reply=reply,
            callback=update_rule if callable(update_rule) else None,
            step=step,
            servers=self._servers,
        )

    def _step_buffer(
        self,
        fields: Meta,
        role: str,
        *,
        ranks: tuple[Sequence[int], Sequence[int]],
        dtype: np.dtype[Any],
    ) -> np.ndarray[Any, Any]:
        """An update callback's step buffer (the model, then the update: this rank's shard
        of each) for the ``ps_open`` request ``fields`` of a server or replica, which it
        names there.

        Raises:
            UsageError: a worker, or a rank not among its role's ``ranks`` (servers, replicas).
        """
        # imported here, where a callback needs it: the worker engine (consistency, storage,
        # push) added some 6 ms to every `import fabricd` (docs/performance.md)
        from fabricd.engines.ps.worker import shard_bounds

        if role == "worker":
            raise UsageError("an update callback belongs to servers and replicas")
        servers, replicas = ranks
        mine = list(servers if role == "server" else replicas)
        if self.rank not in mine:
            raise UsageError(f"rank {self.rank} is not one of the {role} ranks {mine}")
        lo, hi = shard_bounds(fields["size"], len(servers))[mine.index(self.rank)]
        step = self._arrays.create(f"ps:{fields['name']}:step", (2, hi - lo), dtype.name)
        where, offset = self._arrays.locate(step)
        fields.update(step_seg=where, step_off=offset, step_nbytes=step.nbytes)
        return step

    # -- control ----------------------------------------------------------------------------
    def status(self, timeout: float = 10.0) -> Meta:
        """The daemon's status (what ``fabricctl status`` prints)."""
        return self._call("status", timeout=timeout)

    def stalls(self, timeout: float = 10.0) -> Meta:
        """Operations pending longer than ``stall_after`` on the daemon, with what each waits
        for (what ``fabricctl stalls`` prints): ``{"node", "stall_after", "stalls": [...],
        "left_out", "hidden"}`` (the 1000 pending longest; ``left_out`` counts the rest)."""
        return self._call("stalls", timeout=timeout)

    def config(self, timeout: float = 10.0) -> Meta:
        """The daemon's effective configuration with each value's source."""
        result: Meta = self._call("config", timeout=timeout)["config"]
        return result

    def poll(self, timeout: float | None = 0.0) -> list[Event]:
        """The events the daemon pushed, oldest first, waiting up to ``timeout`` s for one.

        Events that arrive while any thread waits for a reply are read and kept for this call
        (up to 10,000; past that the oldest are dropped and counted in
        :attr:`events_dropped`).  ``timeout=0`` reads what has already arrived and never
        blocks; ``None`` waits until an event comes.  Returns ``[]`` if none came in time.

        Raises:
            DaemonUnavailable: the connection has ended and every event was taken (with the
                daemon's reason when it gave one; its code may map to another error).
        """
        return self._connection.poll(timeout)

    @property
    def events_dropped(self) -> int:
        """Events dropped because nobody called :meth:`poll` while 10,000 were queued."""
        return self._connection.events_dropped

    def _call(
        self, op: str, *, timeout: float | None = 10.0, fds: Sequence[int] = (), **fields: Any
    ) -> Meta:
        """Send one request and wait for its reply's fields (the failure raised as its error)."""
        call = self._connection.submit(op, fields, fds=fds)
        return self._connection.wait(call, timeout).result(op)

    # -- the end ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether the connection is closed (by :meth:`close`, or because the daemon went)."""
        return self._connection.closed

    def close(self) -> None:
        """Disconnect; the daemon releases this client's segments and operations.

        Every call still pending raises ``DaemonUnavailable``; arrays stay usable in this
        process.
        """
        self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _env_int(value: object, name: str) -> object:
    """``value``, or ``$name`` parsed as an int when ``value`` is None."""
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"${name}={raw!r} is not an integer") from None


def _env_spin() -> float:
    """``$FABRICD_SPIN_US`` in seconds (0 when unset)."""
    raw = os.environ.get("FABRICD_SPIN_US")
    if raw is None:
        return 0.0
    try:
        micros = float(raw)
    except ValueError:
        micros = math.nan
    if not 0 <= micros <= checks.MAX_SPIN * 1e6:  # (NaN fails this too)
        raise UsageError(
            f"$FABRICD_SPIN_US={raw!r} is not a number of microseconds in "
            f"0..{checks.MAX_SPIN * 1e6:.0f}"
        )
    return micros / 1e6


def _socket_paths(socket_path: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """Where :func:`connect` looks for the daemon, in order.

    ``socket_path``, else ``$FABRICD_SOCKET``, alone; else :func:`fabricd.ipc.socket_candidates`
    (the user's runtime dir, then the system location).
    """
    explicit = checks.socket_path(socket_path) or os.environ.get("FABRICD_SOCKET")
    return (explicit,) if explicit else socket_candidates()


def connect(
    job: str | None = None,
    rank: int | None = None,
    size: int | None = None,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    spin: float | None = None,
) -> Client:
    """Connect to the local daemon and, with ``job``, join it as ``rank`` of ``size``.

    ``rank`` and ``size`` default to ``$RANK`` and ``$WORLD_SIZE`` (as torchrun sets them),
    else, in a task that ``srun`` started, to Slurm's ``$SLURM_PROCID`` and
    ``$SLURM_STEP_NUM_TASKS`` (:func:`fabricd.slurm.task_identity`); the job defaults to
    ``$FABRICD_JOB``.  The socket is ``socket_path``, else ``$FABRICD_SOCKET``, else the first
    that answers of the Slurm job's socket (inside a job whose prolog started a daemon,
    docs/slurm.md), ``$XDG_RUNTIME_DIR/fabricd/fabricd.sock`` (not for root) and
    ``/run/fabricd/fabricd.sock``.  Without a job the client can only query the daemon
    (status, config).

    ``spin`` (seconds, at most 0.01; default ``$FABRICD_SPIN_US`` microseconds, else 0): how
    long a call that waits for the daemon keeps asking before it sleeps.  A reply within the
    spin saves the sleep and the wake-up (tens of microseconds on a virtual machine) at the
    price of a busy core: worth it only on a node with cores to spare (docs/performance.md).

    Raises:
        DaemonUnavailable: no daemon answers (the message lists every socket tried and says
            how to start one), or the daemon refused this process (its reason).
        UsageError: a job name that is not a str of 1..200 characters, rank or size missing or
            not ints, the rank outside ``0..size-1``, the rank is taken, or a spin outside
            0..0.01 s.
        ConfigError: a Slurm variable the rank is read from is malformed
            (:class:`fabricd.slurm.SlurmError`).
    """
    job = job if job is not None else os.environ.get("FABRICD_JOB")
    spun = checks.spin(_env_spin() if spin is None else spin)
    given_rank, given_size = _env_int(rank, "RANK"), _env_int(size, "WORLD_SIZE")
    if job is not None and given_rank is None and given_size is None:
        identity = task_identity(os.environ)  # a task of srun: the step's rank and size
        if identity is not None:
            given_rank, given_size = identity.rank, identity.world_size
    membership = None
    if job is not None:
        if given_rank is None or given_size is None:
            raise UsageError(
                f"joining job {job!r} needs rank and size (or $RANK and $WORLD_SIZE, or a task "
                "of srun)"
            )
        membership = checks.membership(job, given_rank, given_size)
    connection = Connection.open(_socket_paths(socket_path))
    connection.spin = spun
    try:
        return Client(connection, membership, timeout)
    except Timeout:
        raise DaemonUnavailable(
            f"the daemon on {connection.path} did not answer within {timeout}s"
        ) from None
