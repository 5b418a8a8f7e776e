"""The engine: admission, abort, adapters and weights, statistics and the shutdown
sequence (``_open`` starts it).

Everything here runs in the event loop's thread. The engine's threads (see
``_worker``) only post messages, which ``_dispatch`` (``_ledger``, the engine's base)
applies in order; so every status change, every table update and every wake-up of a
waiting task happens here, and the tables are always consistent when a task looks at
them. Updates of the weights and sleep (L102, L103) are ``_weightops``'.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast, final

import anyio
import anyio.lowlevel

from ._adapters import AdapterError, AdapterInfo
from ._checkpoint import CheckpointPolicy
from ._config import EngineConfig
from ._construct import NoPublicConstructor
from ._deadlines import DeadlineTimer
from ._errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
)
from ._estimate import check_deadline, check_step_time
from ._handle import RequestHandle
from ._inbox import LoopInbox
from ._ledger import Ledger
from ._log import log_stuck
from ._messages import Completed, Message, died
from ._outputs import (
    EngineStatistics,
    GenerationOutput,
    RequestStatus,
)
from ._pool import Pool, Withdrawal
from ._reasons import AbortReason
from ._record import Record, wait_shielded
from ._request import GenerationRequest
from ._resultstore import ResultStore
from ._runner import (
    Runner,
    shared_capabilities,
)
from ._runner_adapters import RunnerAdapters
from ._threads import worker_name
from ._validate import check_request_id
from ._weightops import EngineWeights
from ._weights import (
    SleepPolicy,
    SleepReport,
    UpdatePolicy,
    WakeReport,
    WeightSource,
    WeightVersion,
)
from ._worker import Worker
from ._workitem import WorkItem

if TYPE_CHECKING:
    from ._owner import RequestOwner

__all__ = ["Engine"]

_engine_numbers = itertools.count()


@final
class Engine(Ledger, metaclass=NoPublicConstructor, made_by="open_engine()"):
    """Serves generation requests with one runner per device; create it with ``open_engine``."""

    def __init__(self, runners: Sequence[Runner[Any]], config: EngineConfig) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self._capabilities = shared_capabilities(runners)
        self._adapters = RunnerAdapters(
            runners, self._capabilities, alive=lambda: self._alive, lost=self._runner_broke
        )
        self._config = config
        config.check_default_cache(self._capabilities)
        cache = config.result_cache
        self._results = None if cache is None else ResultStore(cache, runners, self.adapters)
        self._weights = EngineWeights(self, runners)  # L102, L103
        self._inbox: LoopInbox[Message[WorkItem]] = LoopInbox(self._dispatch)
        self._pool = Pool(weights=self._config.tenant_weights)
        number = next(_engine_numbers)
        several = len(runners) > 1
        self._workers = [
            Worker(
                runner,
                config,
                self._pool,
                index=index,
                post=self._inbox.post,
                post_quietly=self._inbox.post_quietly,
                name=worker_name(number, index, several=several),
            )
            for index, runner in enumerate(runners)
        ]
        self._pool.workers = self._workers
        # L43: the workers whose threads have not died, and those that exited.
        self._alive = set(range(len(self._workers)))
        self._exited_workers: set[int] = set()
        # Non-terminal requests by id: the engine drives them, so it holds them.
        self._live: dict[str, Record] = {}
        # Terminal requests whose handle is open keep their id (L2); held weakly,
        # so a handle dropped without closing frees its id with it.
        self._terminal_open: weakref.WeakValueDictionary[str, RequestHandle] = (
            weakref.WeakValueDictionary()
        )
        self._counts = dict.fromkeys(RequestStatus, 0)
        self._admitted = 0
        # Member-steps run for requests after their abort was asked, summed.
        self._steps_after_abort = 0
        self._closing = False
        self._grace_deadline = 0.0
        self._dead: EngineDeadError | None = None
        self._exited = anyio.Event()
        self._owner: RequestOwner = _HandleOwner(self)
        # L62: one timer task for every deadline, run by ``open_engine``.
        self._deadlines: DeadlineTimer[Record] = DeadlineTimer(self._expire)

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration."""
        return self._config

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The threads this engine started (each worker's step loop and materializer)."""
        return tuple(thread for worker in self._workers for thread in worker.threads)

    # -- admission -----------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        *,
        request_id: str | None = None,
        checkpoint: CheckpointPolicy | None = None,
        resume_from: bytes | None = None,
        accepted: bool = False,
    ) -> RequestHandle:
        """Admit ``request`` now and return its handle.

        When this returns, the request waits in the queue (L1), or is complete: an exact
        repeat answered from the result cache (L95), admitted as a miss would be (L96).

        Args:
            request: what to generate.
            request_id: the id; a fresh unique one when ``None``.
            checkpoint: take checkpoints of it while it runs (L78): the runner must
                declare ``checkpoints``.
            resume_from: a checkpoint's ``data`` to continue from instead of step 0
                (L78); one the runner refuses is logged, and the request starts
                from step 0.
            accepted: the request was accepted before and is submitted again (a
                durable job after a restart, L77): no estimate refuses it now (the
                step time's, L4; the deadline's, L62), nor the waiting-queue bounds
                (L5, L56: the job store bounds its jobs). The fields and the
                runner's limits are checked as for any request.

        Raises:
            InvalidRequestError: a field is invalid or over a limit (L4).
            DuplicateRequestError: a live request has this id (L2).
            QueueFullError: ``max_waiting`` requests wait already (L5), or
                its tenant's ``tenant_max_waiting`` of them (L56).
            DeadlineError: the engine's estimate says ``deadline_s`` cannot be
                met (L62).
            EngineClosedError: shutdown has begun (L30).
            EngineDeadError: the worker died (L23).
        """
        self._check_admitting()
        self._weights.check_admitting()
        if (checkpoint is not None or resume_from is not None) and not (
            self._capabilities.checkpoints
        ):
            raise InvalidRequestError(
                "this runner takes no checkpoints (it declares no checkpoints capability)",
                field="checkpoint",
            )
        request_id = (
            f"req-{uuid.uuid4().hex}" if request_id is None else check_request_id(request_id)
        )
        if not isinstance(request, GenerationRequest):
            raise InvalidRequestError(
                f"must be a GenerationRequest, got {type(request).__name__}",
                field="request",
                request_id=request_id,
            )
        if request_id in self._live or request_id in self._terminal_open:
            raise DuplicateRequestError(
                f"a live request has the id {request_id!r}", request_id=request_id
            )
        # L80: the request as admitted carries the policy that applies to it.
        request = self._config.with_default_cache(request)
        try:
            self._config.check_request(request)
            self._capabilities.check_request(request)
            self._adapters.check_request(request)
            if not accepted:
                self.check_step_time(request)
        except InvalidRequestError as exc:
            exc.request_id = request_id
            raise
        key = self._capabilities.batch_key(request)
        deadline = None
        if request.deadline_s is not None:
            deadline = anyio.current_time() + request.deadline_s
            if not accepted:
                workers = [self._workers[index] for index in self._alive]
                check_deadline(
                    request,
                    request_id,
                    key=key,
                    deadline=deadline,
                    workers=workers,
                    pool=self._pool,
                )
        record = Record(
            request,
            request_id,
            key,
            event_buffer=self._config.event_buffer,
            deadline=deadline,
        )
        record.checkpoint = checkpoint
        record.resume_from = resume_from
        # L95: an exact repeat is answered now; L96: where a miss would be admitted.
        kept = None if self._results is None else self._results.lookup(record)
        full = self._pool.enqueue(
            record,
            limit=None if accepted else self._config.max_waiting,
            tenant_limit=(
                None
                if request.tenant is None or accepted
                else self._config.tenant_max_waiting.get(request.tenant)
            ),
            deadline=math.inf if deadline is None else deadline,
            queue=kept is None,
        )
        if full is not None:
            raise QueueFullError(full, request_id=request_id)
        if deadline is not None and kept is None:
            self._deadlines.add(record, deadline)
        self._live[request_id] = record
        self._admitted += 1
        handle = RequestHandle._create(self._owner, record)
        if self._results is not None:
            self._results.admitted(record, kept)
        if kept is not None:
            record.weights = self._weights.version  # L102: the version its key names
            self._terminate(record, RequestStatus.COMPLETED, Completed(record, *kept.tensors()))
        return handle

    def check_step_time(self, request: GenerationRequest) -> None:
        """Refuse ``request`` as ``submit`` does if one step of it alone would outlast
        ``EngineConfig.max_step_s`` (L4), by the live workers' measured cost per pixel;
        admits while a live worker has measured no step. For a server that checks a
        request before it costs work (an upload to decode, a job's place).

        Raises:
            InvalidRequestError: naming the field to make smaller.
        """
        check_step_time(
            request,
            workers=[self._workers[index] for index in self._alive],
            limit=self._config.max_step_s,
        )

    async def generate(
        self, request: GenerationRequest, *, request_id: str | None = None
    ) -> GenerationOutput:
        """Submit ``request`` and wait for its output, in the caller's scope.

        Raises:
            RequestError: what ``submit`` raises (the request is refused) and what
                ``RequestHandle.result`` raises (it was aborted or failed).
            EngineClosedError: shutdown has begun (L30).
            EngineDeadError: the worker died (L23).

        Cancellation:
            Cancelling the caller aborts the request (reason ``cancelled``) and
            returns only after the engine released it (L11).
        """
        async with self.submit(request, request_id=request_id) as handle:
            return await handle.result()

    def _check_admitting(self) -> None:
        if self._dead is not None:
            raise self._dead_error()
        if self._closing:
            raise EngineClosedError("the engine is shutting down")

    # -- adapters ------------------------------------------------------------

    async def load_adapter(
        self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]
    ) -> None:
        """Load the LoRA at ``source`` as ``name`` into every runner, while serving (L85).

        Each runner loads its own copy, one after another in a worker thread of
        anyio's; a runner's load waits for its step under way, never changes a
        request in flight. All or nothing: when one runner refuses, the runners
        that loaded it unload it again. A runner that breaks in its load (raises a
        ``BaseException`` that is not an ``Exception``, as a parallel group whose
        rank died does) ends its worker as its own thread would (L23, L43); the
        others load it.

        Raises:
            AdapterError: the runners take no adapters, ``name`` is loaded, ``source``
                is not a LoRA for the model, there is no room, or a load or unload of
                ``name`` is in flight (``reason`` says).
            InvalidRequestError: ``name`` is not an adapter name.
            EngineClosedError: shutdown has begun (L30); nothing is loaded.
            EngineDeadError: the worker died, before or in this load (L23).

        Cancellation: the load under way finishes (shielded) and is undone, then the
            cancellation propagates.
        """
        self._check_admitting()
        digest = None if self._results is None else await self._results.digest(source)
        try:
            await self._adapters.load(name, source)
        except AdapterError:
            self._check_admitting()  # shutdown began meanwhile and closed a runner: say so
            raise
        if self._results is not None:
            self._results.loaded(name, digest)  # L95: part of its requests' keys

    async def unload_adapter(self, name: str) -> None:
        """Unload ``name`` from every runner (L85); refused while a live request holds it.

        Refused before any runner unloads when a request holds it now. A runner where
        a request took hold of it since refuses alone; admission then knows the name
        no more (not every runner has it), and a later unload finishes the others.

        Raises:
            AdapterError: ``unknown`` (no runner has it) or ``in-use`` (a request in
                flight holds it, or a load or unload of it is in flight).
            EngineClosedError: shutdown has begun (L30).
            EngineDeadError: the worker died (L23).

        Cancellation: the unload under way finishes (shielded), then the cancellation
            propagates.
        """
        self._check_admitting()
        await self._adapters.unload(name)
        if self._results is not None:
            self._results.unloaded(name)

    def _runner_broke(self, index: int, exc: BaseException) -> Exception | None:
        """Runner ``index`` raised ``exc`` (not an ``Exception``) outside its worker's
        thread, in an adapter's load: the worker dies of it as of its own (L23, L43),
        now; return the error the load raises (``None``: other workers serve on)."""
        worker = self._workers[index]
        worker.fail(exc)  # its thread raises it at its next boundary and closes the runner
        self._dispatch(died(exc, f"the engine's worker {worker.name} died", worker=index))
        return self._dead_error() if self._dead is not None else None

    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The adapters the runners know, by name (holders summed over the runners)."""
        return self._adapters.infos()

    # -- weights in place, sleep (L102, L103) ----------------------------------

    @property
    def weight_version(self) -> WeightVersion:
        """The weights the engine serves (L102): number 0 until the first update."""
        return self._weights.version

    @property
    def sleep_level(self) -> int:
        """The level the engine sleeps at (L103); 0 while it is awake."""
        return self._weights.level

    async def update_weights(
        self, source: WeightSource, *, policy: UpdatePolicy = "finish", label: str | None = None
    ) -> WeightVersion:
        """Update the runners' weights in place, while serving (L102); return the version.

        From the next step boundary no worker takes a new request; the requests in
        flight ``finish`` on the old weights first (new ones wait), or are aborted
        (``"abort"``: reason ``weights_updated``); then every runner applies ``source``,
        all or nothing, and the waiting requests run on it. No request runs on two
        versions; each output names its own (``GenerationOutput.weight_version``). What
        was made with the old weights is let go of: the runners' prompt caches, the
        result cache's entries (its model names the new weights), the checkpoints taken
        before (another model key: one resumed starts from step 0, logged).

        Args:
            source: a ``.safetensors`` file or a state dict (``WeightSource``); a LoRA
                runs unmerged as every request's base adapter.
            policy: ``"finish"`` or ``"abort"``.
            label: a name for the new weights (``WeightVersion.label``).

        Raises:
            WeightsError: the source does not fit the model, a runner failed (every
                runner is back on the old weights), the engine sleeps, or its runners
                cannot be updated (``reason`` says).
            ValueError: a policy or a label that is not one.
            EngineClosedError: shutdown has begun (L30), before or while it waited.
            EngineDeadError: the worker died (L23).

        Cancellation: waiting for the requests in flight stops, and nothing changed; an
            update under way finishes and is undone on every runner.
        """
        self._check_admitting()
        return await self._weights.update(source, policy=policy, label=label)

    async def sleep(
        self, level: int = 1, *, policy: SleepPolicy = "finish", refuse: bool = False
    ) -> SleepReport:
        """Free the weights' device memory until ``wake`` (L103).

        From the next step boundary no worker takes a new request; the requests in
        flight ``finish`` first, or are suspended exactly (``"suspend"``, L61: they
        resume after the wake with the outputs they would have had). Then level 1 moves
        every weight to host memory; level 2 drops those the model's files hold and
        moves the rest. Requests meanwhile are admitted and wait, or with ``refuse`` are
        refused (``EngineSleepingError``: a server's 503) from this call to the wake.
        Asleep already: nothing is done.

        Returns:
            The bytes freed and the seconds it took.

        Raises:
            WeightsError: the runners cannot sleep (or cannot suspend), or one failed:
                every runner is awake.
            ValueError: a level or a policy that is not one.
            EngineClosedError: shutdown has begun (L30).
            EngineDeadError: the worker died (L23).

        Cancellation: waiting for the requests in flight stops and the engine serves
            on; freeing under way finishes and is undone.
        """
        self._check_admitting()
        return await self._weights.sleep(level=level, policy=policy, refuse=refuse)

    async def wake(self) -> WakeReport:
        """Bring the weights back where they were and serve again (L103): the next step's
        output is the one it would have been before the sleep. Awake: nothing.

        Raises:
            WeightsError: a file a level-2 sleep dropped weights of changed or went
                away; the engine sleeps on.

        Cancellation: the wake of the runner under way finishes; a later ``wake``
            wakes the others.
        """
        return await self._weights.wake()

    # -- abort ---------------------------------------------------------------

    async def abort(self, request_id: str, *, reason: str = AbortReason.USER) -> bool:
        """Abort the live request ``request_id`` and wait until it is released.

        Returns:
            ``True`` once the request is terminal and the engine's threads hold
            nothing of it; ``False`` at once if no live request has that id (L8).

        Cancellation:
            The abort stands; only the wait for the release is cancelled.
        """
        record = self._find_live(request_id, reason)
        if record is None:
            await anyio.lowlevel.checkpoint()
            return False
        self._abort_record(record, reason)
        await record.done.wait()
        return True

    def abort_nowait(self, request_id: str, *, reason: str = AbortReason.USER) -> bool:
        """Request the abort of the live request ``request_id``; never blocks.

        Returns:
            Whether a live request had that id.
        """
        record = self._find_live(request_id, reason)
        if record is None:
            return False
        self._abort_record(record, reason)
        return True

    def _find_live(self, request_id: str, reason: str) -> Record | None:
        self._check_reason(reason)
        return self._live.get(request_id)

    @staticmethod
    def _check_reason(reason: str) -> None:
        if not isinstance(reason, str) or not reason or reason == AbortReason.SHUTDOWN:
            raise ValueError(
                f"reason: must be a non-empty str other than {AbortReason.SHUTDOWN.value!r}"
            )

    def _abort_record(self, record: Record, reason: str) -> None:
        """The one path by which anything ends a request early."""
        if record.status.is_terminal or not record.token.cancel(reason):
            return
        record.mark_abort()
        # L6: a request still in the queue never reaches the worker. Asked of the
        # queue whatever the status reads: a suspended request may be on its way
        # back into it (L61), and only the queue's lock makes the answer exact.
        if self._pool.withdraw(record) is Withdrawal.WITHDRAWN:
            self._terminate(record, RequestStatus.ABORTED, self._cut_error(record))

    def _expire(self, record: Record) -> None:
        """The timer's callback: ``record``'s deadline passed (L62)."""
        try:
            self._abort_record(record, AbortReason.DEADLINE)
        except Exception as exc:  # an engine bug: fail loudly, never crash the loop
            self._die(died(exc, "the engine failed to expire a deadline"))

    # -- statistics ----------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """Return the counts now; never blocks (L19).

        Terminal counts are the loop's own; ``waiting`` is the queue's length, read
        under the queue lock (microseconds); ``running`` is the rest, so the five
        always add up to ``admitted``.
        """
        counts = self._counts
        waiting, suspended = self._pool.counts()
        workers = tuple(
            worker.statistics(alive=worker.index in self._alive) for worker in self._workers
        )
        ended = (
            counts[RequestStatus.COMPLETED]
            + counts[RequestStatus.ABORTED]
            + counts[RequestStatus.FAILED]
        )
        return EngineStatistics(
            admitted=self._admitted,
            waiting=waiting,
            running=self._admitted - ended - waiting,
            completed=counts[RequestStatus.COMPLETED],
            aborted=counts[RequestStatus.ABORTED],
            failed=counts[RequestStatus.FAILED],
            suspended=suspended,
            preemptions=sum(worker.preemptions for worker in workers),
            steps_run=sum(worker.steps_run for worker in workers),
            batch_steps=sum(worker.batch_steps for worker in workers),
            steps_after_abort=self._steps_after_abort,
            workers_alive=len(self._alive),
            workers=workers,
            is_closing=self._closing,
            is_dead=self._dead is not None,
            result_cache=None if self._results is None else self._results.statistics(),
        )

    # -- shutdown ------------------------------------------------------------

    async def aclose(self) -> None:
        """Shut down: stop admission, end every request, join the threads.

        1. ``submit`` raises ``EngineClosedError`` from now on (L30).
        2. Waiting requests end with ``EngineClosedError`` at once (L31).
        3. Running requests get ``shutdown_grace`` seconds to finish, then stop
           at the next step boundary with ``EngineClosedError`` (L32); finished
           results stay readable (L33).
        4. The worker exits, the runner is closed, the threads are joined (L35).
           A worker still running ``stop_timeout_s`` after the cut (a step that
           does not return) is logged at ERROR, with the requests it holds; the
           wait goes on.

        Idempotent; several tasks may call it at once (L36).

        Cancellation:
            Cancelling the grace period ends it early; the rest of the sequence
            (cutting running requests, joining the threads, one step at most)
            completes before the cancellation propagates.
        """
        self._begin_shutdown()
        try:
            if self._live and self._config.shutdown_grace > 0:
                with anyio.CancelScope(deadline=self._grace_deadline):
                    for record in list(self._live.values()):
                        await record.done.wait()
        finally:
            for record in list(self._live.values()):
                self._cut(record)
            self._pool.stop()
            await wait_shielded(
                self._exited, late_s=self._config.stop_timeout_s, on_late=self._log_stuck
            )
            for worker in self._workers:
                worker.join()

    def _log_stuck(self) -> None:
        """Log, at ERROR, each worker that has not exited ``stop_timeout_s`` after the cut."""
        stuck = [w for w in self._workers if w.index not in self._exited_workers]
        log_stuck(stuck, self._config.stop_timeout_s)

    def _begin_shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._grace_deadline = anyio.current_time() + self._config.shutdown_grace
        fresh, releasing = self._pool.withdraw_all()
        for item in releasing:  # suspended (L61): their release message follows
            self._cut(cast(Record, item))
        for item in fresh:
            record = cast(Record, item)
            self._cut(record)
            self._terminate(record, RequestStatus.ABORTED, self._cut_error(record))

    def _cut(self, record: Record) -> None:
        """Mark ``record`` as cut off by shutdown; the worker drops it at its next boundary."""
        if record.token.cancel(AbortReason.SHUTDOWN):
            record.mark_abort()


@final
class _HandleOwner:
    """The engine as its handles see it: implements ``RequestOwner`` (see ``_owner``)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def check_reason(self, reason: str) -> None:
        Engine._check_reason(reason)

    def abort(self, record: Record, reason: str) -> None:
        self._engine._abort_record(record, reason)

    def forget(self, record: Record, handle: RequestHandle) -> None:
        self._engine._forget(record, handle)
