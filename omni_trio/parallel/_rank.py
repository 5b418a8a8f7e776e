"""One rank's model, the same on every rank: a ``DiffusersRunner`` whose model calls are shared.

Every rank holds the whole pipeline and every request's whole state (latents,
scheduler, conditioning), and runs every step's scheduler arithmetic itself, on
the same inputs with the same torch thread count: so every rank's states stay
bitwise equal, and only rank 0 decodes (locally, in the engine's materializer,
with no collective). What the ranks share is each model call (``_denoise``):

- **split** (``cfg``): the call's rows (every member's unconditional rows, then
  its conditional ones, as the single-process runner lays them out) are cut into
  one slice per rank, in order; a request alone runs its unconditional rows on
  rank 0 and its conditional ones on rank 1. Each rank runs its slice; one
  all-gather (float32, with each rank's "left" flag, see ``_agree``) gives every
  rank the whole prediction. A slice past the rows (more ranks than rows) runs
  nothing and sends zeros.
- **sequence** (``ulysses``, ``ring``): every rank makes the whole call; diffusers'
  context parallelism (``_context``) splits its tokens over the ranks and gathers
  the output.
- **by load** (a sequence layout with ``by_load``): a call of at least one row
  per rank is split by rows, as the split does (a guided request alone, or a
  batch: every rank runs whole rows and no block exchanges tokens, one gather
  per call), and a call of fewer rows by tokens. Every rank makes the same
  choice from the call's rows, which all ranks hold alike; the switch
  (``ContextSwitch``) turns the sequence split off and on between calls.

Step caching, one way per layout (a layout by load takes none: its calls change
way, and a cache's tensors could not follow):

- sequence: every rank keeps its token slice of each cached row's residuals, and
  decides from the group's sums (``runners.token_split``: one all-gather of two floats
  per deciding row per call), so every rank skips the same rows and so makes the same
  collectives;
- split: every rank decides for its slice of the rows alone (``runners.rows_slice``),
  then sends the others its slice's updates (the ``Exchange`` the step cache declares:
  one all-gather of a record per row, one of the computed rows' residuals), so every
  rank holds every row's whole cache and a row that moves to another rank with the
  batch finds its cache there.

Adapters: every rank loads each adapter itself (rank 0's ops say which, in order with
the joins and drops, so every rank's adapters are held, released and evicted alike).
A call by rows gives each rank's slice its own rows' adapters (``rows_slice`` narrows
every feature of the call to the slice); a call by tokens keeps every row, so its
adapters are the call's.

The rank knows the call's features only through the model call's room
(``omni_trio.runners``' ``rows_slice``, ``token_split``, ``Exchange``): it imports no
feature's private names.

``RankStates`` is the other ranks' copy of the group's states, kept by applying
rank 0's ops in order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._codec import request_from_record
from .._runner import StopRun
from ..runners import DiffusersRunner, Exchange, rows_slice, token_split
from ._agree import Agreement, choose
from ._context import (
    ContextSwitch,
    enable_context_parallel,
    ignore_gather_deprecation,
    ring_attention,
    waited,
)
from ._group import all_gather, loopback_interfaces
from ._plan import Op, OpKind

__all__ = ["Layout", "RankRunner", "RankStates", "Way", "state_digest"]

LayoutKind = Literal["cfg", "ulysses", "ring"]

#: How one model call was shared: its rows cut over the ranks, or its tokens.
Way = Literal["rows", "tokens"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """How a request is spread over the ranks: ``kind`` over ``degree`` ranks.

    ``by_load`` (sequence kinds only): a call with a row per rank or more is split
    by rows instead (see the module doc).
    """

    kind: LayoutKind
    degree: int
    by_load: bool = False

    @property
    def agreement(self) -> Agreement:
        """How the ranks agree on leaving a step (``_agree``)."""
        if self.kind == "cfg":
            return "split"
        return "by-load" if self.by_load else "announced"

    def way(self, rows: int) -> Way:
        """How a model call of ``rows`` rows is shared."""
        if self.kind == "cfg" or (self.by_load and rows >= self.degree):
            return "rows"
        return "tokens"


class RankRunner(DiffusersRunner):
    """A ``DiffusersRunner`` on one rank of a group, its model calls shared as ``layout`` says.

    Args:
        pipeline: this rank's pipeline.
        layout: how the calls are shared.
        rank: this rank.
        options: ``DiffusersRunner``'s keyword options (the batch and the adapters'
            bounds), the same on every rank.
    """

    def __init__(self, pipeline: Any, *, layout: Layout, rank: int, **options: Any) -> None:
        super().__init__(pipeline, **options)
        self.pipeline = pipeline
        self._layout = layout
        self._rank = rank
        #: The model calls made each way (every rank counts the same).
        self.calls: dict[str, int] = {"rows": 0, "tokens": 0}
        #: Set once context parallelism is on, for a layout by load.
        self.switch: ContextSwitch | None = None

    def share_context(self, stack: ExitStack) -> None:
        """Turn on the layout's context parallelism (sequence layouts; the split has
        none): every rank, once it joined the group, in the same order (it makes the
        mesh's groups). What stays set up in the process until the rank closes (ring
        attention's wrapper) goes on ``stack``."""
        layout = self._layout
        if layout.kind == "cfg":
            return
        if layout.kind == "ring":
            stack.enter_context(ring_attention())
        with loopback_interfaces():
            enable_context_parallel(self.pipeline, layout.kind, layout.degree)
        if layout.by_load:
            self.switch = ContextSwitch(self.pipeline)

    def _denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        way = self._layout.way(rows.shape[0])
        self.calls[way] += 1
        if self._layout.by_load:
            assert self.switch is not None
            choose(split=way == "rows")
            self.switch.set(way == "tokens")
        if way == "rows":
            return self._split(rows, t, cond, shared)
        ignore_gather_deprecation()
        if self.family == "qwen-image":
            cond = _text_padded(cond, self._layout.degree)
        with token_split(self._summed):
            return waited(super()._denoise(rows, t, cond, shared))

    def _summed(self, sums: torch.Tensor) -> torch.Tensor:
        """The group's total of every rank's ``sums`` (a step cache's, ``token_split``),
        added in rank order: the same bits on every rank, so every rank skips alike."""
        world = self._layout.degree
        gathered = sums.new_empty((world * sums.shape[0], *sums.shape[1:]))
        all_gather(gathered, sums.contiguous())
        parts = gathered.view(world, *sums.shape)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def _split(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        count, world = rows.shape[0], self._layout.degree
        chunk = -(-count // world)
        low, high = min(count, self._rank * chunk), min(count, (self._rank + 1) * chunk)
        shape = rows.shape[1:]
        size = chunk * math.prod(shape)
        # One float32 buffer: the slice's predictions, then this rank's "left" flag.
        send = torch.zeros(size + 1, dtype=torch.float32, device=rows.device)
        with rows_slice(low, high) as exchanges:
            if high > low:
                part = {name: value[low:high] for name, value in cond.items()}
                try:
                    out = super()._denoise(rows[low:high], t[low:high], part, shared)
                except StopRun:
                    send[-1] = 1.0
                else:
                    if out.shape != rows[low:high].shape:
                        raise ValueError(
                            "the split needs predictions shaped as the rows: got"
                            f" {tuple(out.shape)} for rows {tuple(rows[low:high].shape)}"
                        )
                    send[: out.numel()].copy_(out.reshape(-1))
        gathered = torch.empty(world * (size + 1), dtype=torch.float32, device=rows.device)
        all_gather(gathered, send)
        table = gathered.view(world, size + 1)
        if bool(table[:, -1].any()):
            raise StopRun
        for exchange in exchanges:
            self._exchange(exchange, chunk, count, rows.device)
        whole = table[:, :-1].reshape(world * chunk, *shape)[:count]
        return whole.to(rows.dtype)

    def _exchange(self, exchange: Exchange, chunk: int, count: int, device: torch.device) -> None:
        """Every rank's updates of its slice to every rank, as a feature of the call
        declared them (``Exchange``: the step cache's): the records first (with each
        rank's payload size), then the payloads padded to the largest; none when no rank
        has a payload. The same collectives on every rank: every rank's states hold the
        same updates."""
        world = self._layout.degree
        meta, payload = exchange.pack(chunk)
        fields = chunk * exchange.fields
        send = torch.empty(fields + 1, dtype=torch.float32, device=device)
        send[:fields].copy_(meta.reshape(-1))
        send[fields] = float(payload.numel())
        records = torch.empty(world * (fields + 1), dtype=torch.float32, device=device)
        all_gather(records, send)
        records = records.view(world, fields + 1)
        sizes = [int(size) for size in records[:, fields].tolist()]
        most = max(sizes)
        payloads: torch.Tensor | None = None
        if most:
            padded = torch.zeros(most, dtype=torch.float32, device=device)
            padded[: payload.numel()].copy_(payload)
            payloads = torch.empty(world * most, dtype=torch.float32, device=device)
            all_gather(payloads, padded)
            payloads = payloads.view(world, most)
        others = [
            (
                min(count, rank * chunk),
                records[rank, :fields].reshape(chunk, exchange.fields).cpu(),
                payloads[rank] if payloads is not None else payload,
            )
            for rank in range(world)
            if rank != self._rank
        ]
        exchange.merge(others, self._hidden_dtype())

    def _hidden_dtype(self) -> torch.dtype:
        """The denoiser's dtype (its hidden states', the step cache's tensors')."""
        denoiser = getattr(self.pipeline, "transformer", None)
        return torch.float32 if denoiser is None else denoiser.dtype


def _text_padded(cond: dict[str, torch.Tensor], degree: int) -> dict[str, torch.Tensor]:
    """Qwen-Image's text conditioning padded (and masked) to a multiple of ``degree`` tokens.

    Context parallelism splits the text tokens too; the padding is masked out of
    every attention, so the result is the unpadded one's (float tolerance).
    """
    text = cond["encoder_hidden_states"]
    rows, length = text.shape[0], text.shape[1]
    missing = -length % degree
    if missing == 0:
        return cond
    mask = cond.get("encoder_hidden_states_mask")
    if mask is None:
        mask = torch.ones(rows, length, dtype=torch.bool, device=text.device)
    padded = dict(cond)
    padded["encoder_hidden_states"] = torch.cat(
        [text, text.new_zeros(rows, missing, text.shape[2])], dim=1
    )
    padded["encoder_hidden_states_mask"] = torch.cat([mask, mask.new_zeros(rows, missing)], dim=1)
    return padded


def state_digest(state: Any) -> str:
    """A digest of a state's latents, position and steps (equal: bitwise equal)."""
    digest = hashlib.sha256(f"{state.position}/{state.steps_done}".encode())
    latents = state.latents
    if latents is not None:
        latents = waited(latents).detach().to("cpu").contiguous()
        digest.update(str(latents.dtype).encode())
        digest.update(latents.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class RankStates:
    """A rank's copy of the group's request states, by key, kept by rank 0's ops.

    A join that fails here is remembered, not fatal: rank 0 failed it too (the
    request fails alone, L22) and its drop follows; a step that names it is the
    group's failure. An adapter's load that fails here is remembered for the
    ``ADAPTERS`` plan's answer (``load_failures``): rank 0 then undoes its own load
    and has every rank unload it; an unload that fails is the group's failure (the
    ranks' adapters differ). So are an update of the weights, a sleep and a wake
    (L102, L103): one that fails here is answered, and rank 0 has every rank undo it.
    """

    def __init__(self, runner: RankRunner) -> None:
        self._runner = runner
        self._states: dict[int, Any] = {}
        self._failed: dict[int, str] = {}
        self.load_failures: list[str] = []

    def apply(self, ops: Iterable[Op]) -> None:
        """Apply ``ops`` in order."""
        for op in ops:
            match op.kind:
                case OpKind.JOIN:
                    assert op.request is not None
                    try:
                        self._states[op.key] = self._runner.prepare(
                            request_from_record(op.request), op.request_id
                        )
                    except Exception as exc:
                        self._failed[op.key] = f"{type(exc).__name__}: {exc}"
                case OpKind.DROP:
                    self._failed.pop(op.key, None)
                    state = self._states.pop(op.key, None)
                    if state is not None:
                        self._runner.discard(state)
                case OpKind.SUSPEND:
                    self._runner.suspend(self._states[op.key], to_host=op.to_host)
                case OpKind.RESUME:
                    self._runner.resume(self._states[op.key])
                case OpKind.CACHE_THRESHOLD:
                    self._runner.set_cache_threshold(self._states[op.key], op.threshold)
                case OpKind.LOAD_ADAPTER:
                    try:
                        self._runner.load_adapter(op.name, op.source)
                    except Exception as exc:
                        self.load_failures.append(f"{type(exc).__name__}: {exc}")
                case OpKind.UNLOAD_ADAPTER:
                    if op.name in self._runner.adapter_names():  # not if its load failed here
                        self._runner.unload_adapter(op.name)
                case _:
                    self._weights(op)

    def _weights(self, op: Op) -> None:
        """An op on the weights (L102, L103). An update, a sleep or a wake that fails is
        answered; a commit or a revert that fails is the group's failure."""
        runner = self._runner
        match op.kind:
            case OpKind.COMMIT_WEIGHTS:
                runner.commit_weights()
                return
            case OpKind.REVERT_WEIGHTS:
                runner.revert_weights()
                return
        try:
            match op.kind:
                case OpKind.UPDATE_WEIGHTS:
                    runner.update_weights(op.source, key=op.name)
                case OpKind.SLEEP_WEIGHTS:
                    runner.sleep_weights(op.key)
                case OpKind.WAKE_WEIGHTS:
                    runner.wake_weights()
        except Exception as exc:
            self.load_failures.append(f"{type(exc).__name__}: {exc}")

    def members(self, keys: Sequence[int]) -> list[Any]:
        """The states of a step's members, in order.

        Raises:
            RuntimeError: one of them failed to prepare on this rank alone.
        """
        missing = [key for key in keys if key not in self._states]
        if missing:
            reasons = "; ".join(self._failed.get(key, "never joined") for key in missing)
            raise RuntimeError(f"a step names states this rank does not hold: {reasons}")
        return [self._states[key] for key in keys]

    def digests(self) -> dict[str, str]:
        """Every state this rank holds: its request id -> ``state_digest``."""
        return {state.request_id: state_digest(state) for state in self._states.values()}

    def discard_all(self) -> None:
        """Free every state (the group is closing)."""
        for state in self._states.values():
            self._runner.discard(state)
        self._states.clear()
        self._failed.clear()
