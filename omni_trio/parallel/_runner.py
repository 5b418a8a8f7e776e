"""``ParallelRunner``: one request over several ranks, one engine worker (L40, L41, L48, L49).

Rank 0 is the engine's process: the engine's worker thread calls this runner as
it calls any runner, and this runner is rank 0 (its model, its states, its
decodes). Ranks 1..N-1 are processes it owns (``_start`` starts the group and
reaps it), each with the whole pipeline, built from the same picklable factory,
looping on "read a plan, run it" (``_child``). At every call that changes the
group's states (a join, a drop, a suspension, a resumption) and at every step,
rank 0 sends a plan (``_plan``) down every rank's control pipe before it makes any
collective itself, so every rank makes the same steps and so the same collectives
in the same order (L40).
Cancel points are agreed (``_agree``): all ranks leave a step at the same point.
Adapters load on rank 0 first (its validation is the load's), then on every other
rank, all or nothing; their loads and unloads are ops in the same order as the
joins and drops, so every rank holds and evicts the same adapters (L85-L87). An update
of the weights, a sleep and a wake go the same way (L102, L103).
What the engine and the server read of the caches is rank 0's, in this process, with
no message: the result cache's fingerprint (L95: the layout and rank 0's model) and
the prompt cache's statistics (L94: every rank's cache sees the same requests).

The group is fatal as a whole: a rank that dies, a collective that times out
(``timeout_s``), a step that fails part-way, any failure once a plan is out,
raises ``ParallelGroupError``, a ``BaseException``: the engine's worker dies with
it (its requests fail with ``EngineDeadError``, or ``RequestFailedError`` when the
engine has other workers, L43), and the worker's last call, ``close``, reaps every
rank (L41). A group cannot fail one batch and serve on: which collective a
failed rank was in is unknown, and pairing the next step's with it would be
silently wrong.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any

import torch

from .._adapters import AdapterError, AdapterInfo
from .._cancelpoint import armed, current_check
from .._codec import request_record
from .._request import GenerationRequest
from .._runner import RunnerCapabilities, StopRun
from .._stepcache import CacheMetrics, PromptCacheMetrics
from .._weights import SleepBytes, WeightsError, WeightSource
from ..runners import PromptCacheStatistics
from ._agree import agreed_check
from ._plan import Op, OpKind, Plan, PlanKind, RankReport, encode_plan, picklable_source
from ._processes import receive
from ._rank import RankRunner, state_digest
from ._start import failure_reasons, layout_of, start_group

__all__ = ["ParallelGroupError", "ParallelRunner", "ParallelState"]

#: Seconds the ranks get to exit by themselves at a clean close before SIGKILL.
_CLOSE_GRACE_S = 10.0


class ParallelGroupError(BaseException):
    """The parallel group cannot serve any more: a rank died, a collective timed out,
    or a step failed part-way; the message says which rank and why.

    A ``BaseException``, so that the engine's worker dies with its runner (L23,
    L43) instead of failing one batch and going on with a broken group.
    """


class ParallelState:
    """One request in a ``ParallelRunner``: its key on every rank, and rank 0's state."""

    __slots__ = ("inner", "key", "request_id")

    def __init__(self, key: int, request_id: str, inner: Any) -> None:
        self.key = key
        self.request_id = request_id
        self.inner = inner


class ParallelRunner:
    """Run each request over several ranks: a classifier-free-guidance split or sequence parallel.

    ``ParallelRunner(factory, cfg=2)``: each request's unconditional and conditional
    rows run on different ranks and are combined every step; ``ulysses=2`` or
    ``ring=2``: each model call's tokens are split over the ranks (diffusers'
    context parallelism: DiT families with a context-parallel plan, Flux,
    Qwen-Image, Wan, LTX-Video). The output equals the single-process
    ``DiffusersRunner``'s for the same seed (float tolerance, L48). To the engine
    it is one runner, one worker: it batches, joins, preempts and resumes, obeys
    deadlines and shutdown (L49). Decodes run on rank 0 (the engine's process),
    which holds every request's whole latents.

    The constructor blocks until every rank is up (a model load per rank); pass
    the runner to ``open_engine``, which closes it (``close`` reaps the ranks).

    Args:
        factory: builds the pipeline, in this process and in every rank's; it
            must pickle (a module-level function, or a ``functools.partial`` of
            one): ``functools.partial(tiny_pipeline, "sd")``.
        cfg: ranks of a classifier-free-guidance split.
        ulysses: ranks of Ulysses sequence parallelism.
        ring: ranks of ring-attention sequence parallelism.
        by_load: with ``ulysses`` or ``ring``, split each model call by its rows
            instead when it has at least one row per rank (a request with
            classifier-free guidance, or a batch of requests), and by its tokens
            only below that: one request alone runs over every rank (latency),
            a full batch runs whole rows on each rank with no token exchange
            (throughput). Every rank chooses alike, call by call, so the way
            changes at step boundaries as requests join and leave.
        devices: one torch device per rank (``cuda:0``, ``cuda:1``: NCCL); ``None``:
            the CPU, where the factory builds (gloo).
        timeout_s: every collective's timeout: a rank that hangs fails the group
            within it.
        start_timeout_s: how long the ranks may take to build their pipelines.
        torch_threads: torch's intra-op threads per rank; ``None``: the cores
            over the ranks (at least 1). It is set in this process too (torch's
            count is process-wide), and every rank follows rank 0's count, so
            their states stay bitwise equal.
        max_batch_size: most requests one step serves.
        max_adapters: the most adapters one request may name (L85; as
            ``DiffusersRunner``'s, 0 for a pipeline that takes none).
        max_loaded_adapters: the most adapters each rank holds loaded at once (L87).
        max_adapter_bytes: the most bytes of loaded adapters' weights per rank, or
            ``None``.
        prompt_cache_bytes: the most bytes of text encodings each rank keeps (L94;
            0 keeps none); ``None``: ``DiffusersRunner``'s default.

    Raises:
        ValueError: not exactly one of ``cfg``, ``ulysses``, ``ring`` above 1, bad
            devices, heads (Ulysses) that do not divide by the ranks, or a
            ``prompt_cache_bytes`` below 0 (rank 0's runner refuses it as it starts).
        TypeError: the factory does not pickle, or its pipeline cannot run the
            layout (sequence parallel needs a context-parallel plan).
        ParallelStartError: a rank did not start.

    Only one ``ParallelRunner`` may be open in a process: diffusers' context
    parallelism needs torch.distributed's one default group.
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        cfg: int = 1,
        ulysses: int = 1,
        ring: int = 1,
        by_load: bool = False,
        devices: Sequence[str] | None = None,
        timeout_s: float = 60.0,
        start_timeout_s: float = 600.0,
        torch_threads: int | None = None,
        max_batch_size: int = 8,
        max_adapters: int = 4,
        max_loaded_adapters: int = 16,
        max_adapter_bytes: int | None = None,
        prompt_cache_bytes: int | None = None,
    ) -> None:
        layout = layout_of(cfg, ulysses, ring, by_load)
        self._layout = layout
        self._timeout_s = float(timeout_s)
        self._lock = threading.Lock()  # the control pipes: one sender at a time
        # Rank 0's book: the live states, their state changes and the ops queued for
        # the other ranks change together under it, so a report sees rank 0 exactly
        # as the plan it sends leaves the others (reentrant: ``_send`` drains the ops).
        self._book_lock = threading.RLock()
        self._ops: list[Op] = []
        self._keys = itertools.count(1)
        self._seq = 0
        self._live: dict[int, ParallelState] = {}
        self._broken: str | None = None
        self._closed = False
        self._fingerprint: str | None = None
        options: dict[str, Any] = {
            "max_batch_size": max_batch_size,
            "max_adapters": max_adapters,
            "max_loaded_adapters": max_loaded_adapters,
            "max_adapter_bytes": max_adapter_bytes,
        }
        if prompt_cache_bytes is not None:
            options["prompt_cache_bytes"] = prompt_cache_bytes
        self._group, runner = start_group(
            factory,
            layout,
            devices=devices,
            timeout_s=self._timeout_s,
            start_timeout_s=start_timeout_s,
            torch_threads=torch_threads,
            options=options,
        )
        self._runner: RankRunner | None = runner
        # What ``prompt_cache_statistics`` answers once rank 0's runner is let go of
        # (``close`` renews it).
        self._prompts_closed = runner.prompt_cache_statistics()
        self._family = runner.family
        inner = runner.capabilities
        multiple = inner.size_multiple * (1 if layout.kind == "cfg" else layout.degree)
        # Step caching on one way per group: the split (every rank keeps whole caches,
        # exchanged after each call) or a token split (every rank its token slice);
        # not by load, whose calls change way while a cache's tensors could not.
        # Checkpoints are refused: a restore would have to reach every rank.
        self._capabilities = dataclasses.replace(
            inner,
            size_multiple=multiple,
            step_cache=frozenset() if layout.by_load else inner.step_cache,
            checkpoints=False,
            # Not yet (L100): a sampled request's trajectory is rank 0's alone to return.
            samplers=frozenset(),
        )

    # -- what the engine sees -------------------------------------------------

    @property
    def capabilities(self) -> RunnerCapabilities:
        """The single-process runner's, the size multiple times the ranks for sequence parallel."""
        return self._capabilities

    @property
    def family(self) -> str:
        """The model family (as ``DiffusersRunner.family``)."""
        return self._family

    @property
    def layout(self) -> str:
        """``"cfg"``, ``"ulysses"`` or ``"ring"``."""
        return self._layout.kind

    @property
    def by_load(self) -> bool:
        """Whether a call with a row per rank is split by rows (``by_load``)."""
        return self._layout.by_load

    def calls(self) -> dict[str, int]:
        """The model calls made each way so far, ``"rows"`` and ``"tokens"`` (rank 0's
        count, which every rank of a sound group shares; no round trip: any thread)."""
        return dict(self._model.calls)

    @property
    def world_size(self) -> int:
        """How many ranks, this process's included."""
        return self._layout.degree

    @property
    def pids(self) -> tuple[int, ...]:
        """The process ids of ranks 1..N-1."""
        return self._group.ranks.pids

    @property
    def pipeline(self) -> Any:
        """Rank 0's pipeline (the engine's process), until ``close``."""
        return self._model.pipeline

    @property
    def live_states(self) -> int:
        """How many request states rank 0 holds now (0 once closed)."""
        return 0 if self._runner is None else self._runner.live_states

    @property
    def _model(self) -> RankRunner:
        runner = self._runner
        if runner is None:
            raise ParallelGroupError("the runner is closed")
        return runner

    def prepare(self, request: GenerationRequest, request_id: str) -> ParallelState:
        """Prepare the request on every rank at once (rank 0's seed for all)."""
        if request.seed is None:
            request = dataclasses.replace(request, seed=secrets.randbits(63))
        key = next(self._keys)
        record = request_record(request, images="tensor")
        join = Op(kind=OpKind.JOIN, key=key, request=record, request_id=request_id)
        # Under the plan lock throughout: no report falls between the join the other
        # ranks apply and rank 0's own state.
        with self._lock:
            self._send(PlanKind.OPS, extra=(join,))
            try:
                inner = self._model.prepare(request, request_id)
            except BaseException:
                self._queue(Op(kind=OpKind.DROP, key=key))
                raise
            state = ParallelState(key, request_id, inner)
            with self._book_lock:
                self._live[key] = state
        return state

    def step(self, states: Sequence[ParallelState]) -> None:
        """Run one step on every rank: the plan first, then the shared model calls.

        Raises:
            StopRun: the engine left the step, every rank at the same point (L48).
            ParallelGroupError: the group broke (L41).
        """
        with self._lock:
            seq = self._send(PlanKind.STEP, members=tuple(state.key for state in states))
            engine = current_check()
            check = agreed_check(
                self._layout.agreement, self._group.flags, seq, writer=True, engine=engine
            )
            try:
                with armed(check):
                    self._model.step([state.inner for state in states])
            except StopRun:
                raise
            except BaseException as exc:
                raise self._failure(exc, "a step") from exc

    def preview(self, state: ParallelState) -> torch.Tensor:
        """Rank 0's preview."""
        return self._model.preview(state.inner)

    def decode(self, state: ParallelState) -> torch.Tensor:
        """Decode on rank 0 (it holds the whole latents); no collective."""
        return self._model.decode(state.inner)

    def discard(self, state: ParallelState) -> None:
        """Free the state on rank 0 now, on the other ranks at the next plan."""
        with self._book_lock:
            self._live.pop(state.key, None)
            self._queue(Op(kind=OpKind.DROP, key=state.key))
            self._model.discard(state.inner)

    def state_bytes(self, state: ParallelState) -> int:
        """What rank 0 would park (each rank parks as much)."""
        return self._model.state_bytes(state.inner)

    def suspend(self, state: ParallelState, *, to_host: bool) -> None:
        """Park the state on every rank (the others at the next plan)."""
        with self._book_lock:
            self._model.suspend(state.inner, to_host=to_host)
            self._queue(Op(kind=OpKind.SUSPEND, key=state.key, to_host=to_host))

    def resume(self, state: ParallelState) -> None:
        """Bring the state back on every rank (the others at the next plan)."""
        with self._book_lock:
            self._model.resume(state.inner)
            self._queue(Op(kind=OpKind.RESUME, key=state.key))

    # -- step caching (L80-L84) ---------------------------------------------------

    def cache_metrics(self, state: ParallelState) -> CacheMetrics | None:
        """What the request's step cache did (rank 0's: every rank decides alike)."""
        return self._model.cache_metrics(state.inner)

    def set_cache_threshold(self, state: ParallelState, threshold: float) -> None:
        """Use ``threshold`` for the request's next calls on every rank (the others at
        the next plan, before the next step)."""
        with self._book_lock:
            self._model.set_cache_threshold(state.inner, threshold)
            self._queue(Op(kind=OpKind.CACHE_THRESHOLD, key=state.key, threshold=threshold))

    # -- adapters (L85-L87) -----------------------------------------------------

    def load_adapter(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        """Load ``source`` as ``name`` on every rank, all or nothing (``AdapterRunner``).

        Rank 0 loads first (its checks are the load's: a bad file is refused before
        any other rank reads it), then every other rank; if one of them fails, every
        rank unloads it again. Waits for the step under way. A file is read by every
        rank (the ranks share the machine); a state dict is sent to each. A group that
        broke (a rank died) loads nothing: rank 0 lets go of what it loaded.

        Raises:
            AdapterError: rank 0 refused it (as ``DiffusersRunner.load_adapter``),
                another rank could not load it (``invalid``), or the runner is closed.
            InvalidRequestError: ``name`` is not an adapter name.
            ParallelGroupError: the group broke, before or during the load.
        """
        source = picklable_source(source)
        with self._lock:
            if self._closed:
                raise AdapterError(
                    "the runner is closed: it loads nothing", reason="invalid", name=name
                )
            failures = self._on_every_rank(
                "an adapter's load",
                lambda: self._model.load_adapter(name, source),
                Op(kind=OpKind.LOAD_ADAPTER, key=0, name=name, source=source),
                lambda: self._model.unload_adapter(name),
                Op(kind=OpKind.UNLOAD_ADAPTER, key=0, name=name),
            )
            if failures:
                raise AdapterError(
                    f"adapter {name!r}: not loaded on every rank ({'; '.join(failures)})",
                    reason="invalid",
                    name=name,
                )

    def unload_adapter(self, name: str) -> None:
        """Unload ``name`` from every rank (``AdapterRunner``); waits for the step under way.

        Raises:
            AdapterError: no such adapter (``unknown``), or a live request holds it
                (``in-use``): no rank unloads it then.
            ParallelGroupError: the group broke.
        """
        with self._lock:
            with self._book_lock:
                self._model.unload_adapter(name)
                self._ops.append(Op(kind=OpKind.UNLOAD_ADAPTER, key=0, name=name))
            self._send(PlanKind.OPS)

    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The adapters rank 0 knows (every rank of a sound group knows the same); none
        once closed."""
        runner = self._runner
        return () if runner is None else runner.adapters()

    def adapter_names(self) -> frozenset[str]:
        """The adapter names requests may use (rank 0's, the group's); none once closed."""
        runner = self._runner
        return frozenset() if runner is None else runner.adapter_names()

    # -- weights in place and sleep (L102, L103) ---------------------------------

    def update_weights(self, source: WeightSource, *, key: str) -> None:
        """Apply ``source`` on every rank, all or nothing (``WeightsRunner``).

        Rank 0 first (its checks are the update's: a bad source is refused before any
        other rank reads it), then every other rank; if one of them fails, every rank
        reverts it. A file is read by every rank; a state dict is sent to each.

        Raises:
            WeightsError: rank 0 refused it (as ``DiffusersRunner.update_weights``), or
                another rank failed (``failed``); or the runner is closed.
            ParallelGroupError: the group broke, before or during the update.
        """
        source = picklable_source(source)
        self._everywhere(
            "a weights update",
            lambda: self._model.update_weights(source, key=key),
            Op(kind=OpKind.UPDATE_WEIGHTS, key=0, name=key, source=source),
            lambda: self._model.revert_weights(),
            Op(kind=OpKind.REVERT_WEIGHTS, key=0),
        )

    def commit_weights(self) -> None:
        """Every rank forgets what the last update replaced."""
        self._told(lambda: self._model.commit_weights(), Op(kind=OpKind.COMMIT_WEIGHTS, key=0))

    def revert_weights(self) -> None:
        """Every rank puts back what the last update replaced."""
        self._told(lambda: self._model.revert_weights(), Op(kind=OpKind.REVERT_WEIGHTS, key=0))

    def sleep_weights(self, level: int) -> SleepBytes:
        """Free the weights of every rank's device, all or nothing (L103); returns rank
        0's bytes (every rank frees as much on its own device).

        Raises:
            WeightsError: a rank could not (``failed``): every rank is awake.
            ParallelGroupError: the group broke.
        """
        freed: list[SleepBytes] = []
        self._everywhere(
            "a sleep",
            lambda: freed.append(self._model.sleep_weights(level)),
            Op(kind=OpKind.SLEEP_WEIGHTS, key=level),
            lambda: self._model.wake_weights(),
            Op(kind=OpKind.WAKE_WEIGHTS, key=0),
        )
        return freed[0]

    def wake_weights(self) -> None:
        """Bring every rank's weights back (L103); a retry wakes the ranks still asleep.

        Raises:
            WeightsError: a rank could not (``failed``).
            ParallelGroupError: the group broke.
        """
        self._everywhere(
            "a wake", lambda: self._model.wake_weights(), Op(kind=OpKind.WAKE_WEIGHTS, key=0)
        )

    def _everywhere(
        self,
        during: str,
        here: Callable[[], None],
        op: Op,
        undo_here: Callable[[], None] | None = None,
        undo_op: Op | None = None,
    ) -> None:
        """``here`` on rank 0, then ``op`` on every other rank; ``WeightsError`` when one
        of them failed (undone everywhere, as ``_on_every_rank`` does)."""
        with self._lock:
            if self._closed:
                raise WeightsError("the runner is closed", reason="unsupported")
            failures = self._on_every_rank(during, here, op, undo_here, undo_op)
        if failures:
            raise WeightsError(
                f"{during} failed on a rank ({'; '.join(failures)}); every rank is as it was",
                reason="failed",
            )

    def _told(self, here: Callable[[], None], op: Op) -> None:
        """``here`` on rank 0 and ``op`` to every other rank, with no answer."""
        with self._lock:
            with self._book_lock:
                here()
                self._ops.append(op)
            self._send(PlanKind.OPS)

    def _on_every_rank(
        self,
        during: str,
        here: Callable[[], None],
        op: Op,
        undo_here: Callable[[], None] | None,
        undo_op: Op | None,
    ) -> list[str]:
        """``here`` on rank 0, then ``op`` on every other rank (an ``ADAPTERS`` plan);
        return the other ranks' failures, after undoing it on rank 0 (``undo_here``) and
        sending ``undo_op``. Under ``_lock``.

        Rank 0's call and its op take one place among the discards (their releases) of
        other threads, under the book lock: every rank sees one order.

        Raises:
            Exception: what ``here`` raised (no other rank was asked).
            ParallelGroupError: the group broke, before or during (rank 0's undone).
        """
        exited = [code for code in self._group.ranks.exit_codes() if code is not None]
        if self._broken is not None or exited:
            raise self._failure(RuntimeError("a rank has exited"), during)
        with self._book_lock:
            here()
            self._ops.append(op)
        try:
            self._send(PlanKind.ADAPTERS)
            answers = [receive(c, self._timeout_s) for c in self._group.connections]
        except BaseException as exc:
            failure = self._failure(exc, during)
            if undo_here is not None:
                with self._book_lock, suppress(Exception):
                    undo_here()  # nothing of it stays
            raise failure from exc
        failures: list[str] = []
        for rank, answer in enumerate(answers, start=1):
            assert isinstance(answer, tuple) and answer[0] == "adapters", answer
            failures.extend(f"rank {rank}: {text}" for text in answer[1])
        if failures and undo_here is not None:
            with self._book_lock:
                undo_here()
                if undo_op is not None:
                    self._ops.append(undo_op)
            self._send(PlanKind.OPS)
        return failures

    # -- the caches (L94, L95) ------------------------------------------------------

    def result_fingerprint(self) -> str:
        """Name the model and the layout the outputs come from, for an engine's result
        cache (L95): the layout (its kind, its degree, whether it splits by load: each
        adds the ranks' parts in another order, within float tolerance of one process,
        L48, never bitwise) and rank 0's model (``DiffusersRunner.result_fingerprint``;
        every rank builds the same pipeline from the same factory, on the same kind of
        device). Computed in this process, once (the engine asks when it opens): no
        rank is asked, and no request ever waits for it.

        Raises:
            ParallelGroupError: the runner closed before it was first asked.
        """
        with self._lock:  # no step runs: a layout by load switches hooks between calls
            if self._fingerprint is None:
                layout = self._layout
                self._fingerprint = (
                    f"parallel {layout.kind}={layout.degree} by_load={layout.by_load}"
                    f" {self._model.result_fingerprint()}"
                )
            return self._fingerprint

    def prompt_cache_statistics(self) -> PromptCacheStatistics:
        """Rank 0's prompt cache (L94), which stands for every rank's: every rank prepares
        every request alike, so each encodes, keeps and hits the same texts (each holds
        ``bytes`` of its own). Any thread, without a message: rank 0's cache is in this
        process and has a lock of its own, never held across an encode, so a read never
        waits for a step. Once closed: the last counts, holding nothing."""
        runner = self._runner
        if runner is None:
            return self._prompts_closed
        return runner.prompt_cache_statistics()

    def prompt_cache_metrics(self, state: ParallelState) -> PromptCacheMetrics | None:
        """What rank 0's prompt cache did for the request's texts (L94: every rank's did
        the same)."""
        return self._model.prompt_cache_metrics(state.inner)

    def report(self) -> tuple[RankReport, ...]:
        """What every rank holds now, rank 0 first; waits for a step in progress.

        Every rank's ``states`` name the same requests with the same digests while
        the group is sound; the other ranks' reports carry their plan delivery
        times. For tests and benchmarks: it costs a round trip to every rank.

        Raises:
            ParallelGroupError: the group broke.
        """
        with self._lock:
            # Rank 0's digests are of the book the plan leaves: a discard on the
            # worker's thread comes wholly before it (its drop in the plan) or after.
            with self._book_lock:
                self._send(PlanKind.REPORT)
                ours = {s.request_id: state_digest(s.inner) for s in self._live.values()}
            reports = [
                RankReport(rank=0, states=ours, calls=self.calls(), adapters=self.adapters())
            ]
            try:
                for connection in self._group.connections:
                    message = receive(connection, self._timeout_s)
                    assert isinstance(message, tuple) and message[0] == "report", message
                    reports.append(message[1])
            except BaseException as exc:
                raise self._failure(exc, "a report") from exc
            return tuple(reports)

    def close(self) -> None:
        """Stop every rank and reap it (SIGKILL after a grace), destroy the group; idempotent.

        Rank 0's pipeline is let go of too: nothing the group opened stays open.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            grace = 0.0
            if self._broken is None:
                try:
                    self._send(PlanKind.STOP)
                    grace = _CLOSE_GRACE_S
                except ParallelGroupError:
                    pass
            self._group.release(grace=grace)
            # Let go of rank 0's model: diffusers' context parallelism keeps its mesh's
            # groups, and their listening sockets, for as long as the model lives, and
            # the model's modules hold each other in cycles: collect them now.
            runner = self._runner
            if runner is not None:
                # A reader sees the last counts from here on: its series never go back.
                self._prompts_closed = runner.prompt_cache_statistics()
                self._runner = None
                runner.close()
                self._prompts_closed = runner.prompt_cache_statistics()
                del runner
                if self._layout.kind != "cfg":
                    gc.collect()

    # -- the plans ------------------------------------------------------------

    def _queue(self, op: Op) -> None:
        with self._book_lock:
            self._ops.append(op)

    def _send(
        self, kind: PlanKind, *, extra: tuple[Op, ...] = (), members: tuple[int, ...] = ()
    ) -> int:
        """Send one plan (the queued ops, then ``extra``) to every rank; return its number.

        Under ``_lock``.

        Raises:
            ParallelGroupError: the group broke, now or before.
        """
        if self._broken is not None:
            raise ParallelGroupError(self._broken)
        if self._closed and kind is not PlanKind.STOP:
            raise ParallelGroupError("the runner is closed")
        with self._book_lock:
            ops, self._ops = tuple(self._ops), []
        self._seq += 1
        plan = Plan(
            seq=self._seq,
            kind=kind,
            ops=ops + extra,
            members=members,
            threads=torch.get_num_threads(),
            sent_at=time.perf_counter(),
        )
        data = encode_plan(plan)
        try:
            for connection in self._group.connections:
                connection.send_bytes(data)
        except BaseException as exc:
            raise self._failure(exc, "sending a plan") from exc
        return self._seq

    def _failure(self, exc: BaseException, during: str) -> ParallelGroupError:
        """The group is broken by ``exc``: remember why, once; the error to raise."""
        if self._broken is None:
            reasons = failure_reasons(self._group)
            self._broken = (
                f"the parallel group broke during {during}: {type(exc).__name__}: {exc}{reasons}"
            )
        return ParallelGroupError(self._broken)
