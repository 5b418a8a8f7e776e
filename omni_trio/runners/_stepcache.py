"""Step caching inside ``DiffusersRunner``'s model calls, row by row (L80-L84).

The runner owns the cache, never diffusers' global hooks. At construction it wraps
the ``forward`` of every block of each DiT denoiser (its family's ``denoisers`` and
``block_lists``: ``transformer``, and Wan 2.2's ``transformer_2``, whose rows keep
caches of their own) once, in the runner's
``ModuleHooks`` (``_hooks``): counted per module as the cancel points' hooks are and
removed by the last runner's ``close``. A forward pre-hook runs before ``forward``, so
the cancel point (L71) still comes first, on skipped blocks too (L83).

During one model call the step cache has its part of the call's context
(``BlockCache.part``, read through ``_forward.current()``): which rows of the call
belong to which request, and each request's ``RequestCache`` (its policy, per-row
state, counters). Then, in the blocks:

- the head (the first block of the first block list) runs for every row. A
  first-block row's change ratio is ``mean|r - r'| / mean|r'|``, ``r`` the head's
  residual (output minus input hidden states) and ``r'`` that of the last call the
  row computed, each on the row's own tensors, exactly as diffusers'
  ``FirstBlockCache`` computes it for one row; every row's ratio is read with one
  host sync per model call (``.tolist()`` of a stacked tensor), never per block. A
  TaylorSeer row decides from its call count alone (no sync);
- a row skips when its ratio is below its threshold (first-block) or the call is
  not on its compute schedule (taylorseer), after its warm-up; a skipping row's
  hidden states are the head's output plus its cached (or forecast) residual of the
  other blocks. The encoder (text) stream's output after the last block is read by
  none of the covered transformers (Flux, SD3 and Qwen-Image discard it; Wan's and
  LTX-Video's blocks do not return it), so no residual of it is kept: Qwen-Image
  pads each call's text to its longest prompt, and such a residual would not even
  keep its shape from one batch to the next. The last block of a call where some
  rows skip returns ``None`` for it;
- the other blocks (the tail) run only on the rows that compute: the head returns
  their subset; per-row arguments (a small table per block class: the family's
  ``block_specs``, ``BlockSpec``) are sliced, shared ones (rotary embeddings,
  attention kwargs) passed as they are; the last block scatters back into full-batch
  outputs. When every row computes there is
  no slicing at all; when no row of the call has a policy, the wrappers read one
  thread-local and call the block;
- updates (new residuals, counters, forecasts' differences) are kept aside and
  committed only when the model call returned: a call left at a cancel point
  (``StopRun`` from a block's pre-hook) or failed leaves every cache as it was
  before it (L83).

A request's decisions read only its own rows: the same skip pattern alone or in any
batch (L81), up to a ratio that lies within batching's float noise of the threshold.
A call whose tokens are split over several ranks (sequence parallel,
``_forward.token_split``) decides from the group's sums: each rank's head sees its
slice of every row's tokens, so each row's two sums (``|r - r'|`` and ``|r'|``) are
summed over the ranks first, and every rank makes the same decision from the same
numbers (its tensors stay its own token slices).
The per-row state (``_cachestate``: ``RequestCache``, and the blocks' ``BlockSpec``)
lives in the request's ``RequestState.cache``: created by
``prepare``, counted by ``state_bytes``, moved by ``suspend``/``resume`` and dropped by
``discard`` (L82). UNet denoisers are not wrapped: their blocks pass skip
connections from the down to the up blocks, so a residual of "the other blocks" is
not one tensor; a runner over a UNet declares no ``step_cache``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .._stepcache import StepCache
from ._cachestate import BlockLayout, BlockSpec, RequestCache, RowCache, denoiser_blocks, spec_of
from ._forward import Forward, ModelCall, current
from ._hooks import ModuleHooks, has_hook

__all__ = ["NAME", "BlockCache", "BlockLayout", "BlockSpec", "RequestCache", "expert_rows"]

#: The step cache's name in a model call's parts, and its kind of hook (``_hooks``).
NAME = "step-cache"

#: The kinds the wrappers apply.
KINDS = frozenset({"first-block", "taylorseer"})


# -- one model call ---------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Slot:
    """A row of a model call that has a policy: its request's cache and its row there."""

    cache: RequestCache
    row: int


@dataclass(eq=False, slots=True)
class _Update:
    """What a model call changes in one row's cache, committed when the call returns."""

    cache: RequestCache
    row: int
    rows: RowCache
    computed: bool
    blocks: int
    denoiser: int = 0
    residual: torch.Tensor | None = None
    tail: torch.Tensor | None = None

    def commit(self) -> None:
        cache, rows = self.cache, self.rows
        cache.pattern[self.row].append("C" if self.computed else "S")
        if self.computed:
            cache.calls_computed += 1
            cache.blocks_computed += self.blocks
            rows.run = 0
            if self.residual is not None:
                rows.tensors["residual"] = self.residual
            assert self.tail is not None  # the last block ran
            if cache.policy.kind == "taylorseer":
                _advance_forecast(rows, self.tail, order=cache.policy.order or 1)
            else:
                rows.tensors["tail"] = self.tail
            rows.computed_at = rows.calls
        else:
            cache.calls_skipped += 1
            cache.blocks_computed += 1  # the head
            cache.blocks_skipped += self.blocks - 1
            rows.run += 1
        rows.calls += 1


def _advance_forecast(rows: RowCache, tail: torch.Tensor, *, order: int) -> None:
    """TaylorSeer: fold a computed residual into its finite differences, up to ``order``."""
    tensors = rows.tensors
    previous = tensors.get("tail")
    tensors["tail"] = tail
    if previous is None:
        return
    gap = rows.calls - rows.computed_at
    first = (tail - previous) / gap
    if order >= 2 and "tail_1" in tensors:
        tensors["tail_2"] = (first - tensors["tail_1"]) / gap
    tensors["tail_1"] = first


def _forecast(rows: RowCache) -> torch.Tensor:
    """TaylorSeer's forecast of the other blocks' residual at the row's current call."""
    tensors = rows.tensors
    forecast = tensors["tail"]
    distance = rows.calls - rows.computed_at
    first = tensors.get("tail_1")
    if first is not None:
        forecast = forecast + first * distance
        second = tensors.get("tail_2")
        if second is not None:
            forecast = forecast + second * (distance * distance / 2)
    return forecast


class _Call:
    """The step cache's part of one model call (``_forward.CallPart``): per row its
    ``_Slot`` or ``None``, and the call's pending updates.

    A rank's slice of the call (``narrowed``) is a ``_Call`` of its rows, whose updates
    its ``RowSlice`` exchange adds to the whole call's, with the other ranks'.
    """

    __slots__ = ("active", "forward", "low", "outer", "slots", "updates")

    def __init__(self, slots: list[_Slot | None], outer: _Call | None = None, low: int = 0) -> None:
        self.slots = slots
        #: The rows of the denoiser forward under way (a Wan 2.2 expert's subset).
        self.active = slots
        self.updates: list[_Update] = []
        #: The denoiser forward under way, from its head to its last block.
        self.forward: _Forward | None = None
        #: The whole call, for a rank's slice from row ``low``; ``None``: the whole call.
        self.outer = outer
        self.low = low

    def narrowed(self, low: int, high: int) -> _Call:
        """The call's rows ``low..high``: the step cache decides for them only."""
        return _Call(self.slots[low:high], outer=self, low=low)

    def exchange(self) -> RowSlice | None:
        """A slice's updates, to exchange with the other ranks' (``RowSlice``)."""
        return None if self.outer is None else RowSlice(self)

    def commit(self) -> None:
        for update in self.updates:
            update.commit()


def _current() -> _Call | None:
    forward = current()
    part: _Call | None = None if forward is None else forward.part(NAME)
    return part


def _set_forward(call: _Call, run: _Forward | None) -> None:
    """The denoiser forward under way (its head ran) or none (its last block ran); the
    model call's context says which rows compute (``Forward.computing``, for adapters)."""
    call.forward = run
    forward = current()
    if forward is not None:
        forward.computing = None if run is None else run.computing


@contextmanager
def expert_rows(mask: Sequence[bool]) -> Iterator[None]:
    """Inside, the model call's forward runs on the rows where ``mask`` holds (Wan 2.2)."""
    call = _current()
    if call is None:
        yield
        return
    saved = call.active
    call.active = [slot for slot, keep in zip(call.slots, mask, strict=True) if keep]
    try:
        yield
    finally:
        call.active = saved


class RowSlice:
    """A rank's slice of a model call split by rows: the step cache's ``_forward.Exchange``.

    The step cache decides for the slice's rows only (the rank runs them alone). Its
    updates stay aside until ``merge``, which adds them and the other ranks' (unpacked
    from their ``pack``) to the whole call, to be committed with it: every rank's copy
    of every request's cache then makes the same updates as one process.
    """

    #: ``pack``'s record per row: flag (-1 no policy, 0 skipped, 1 computed), denoiser,
    #: blocks, whether a head residual follows, the hidden states' tokens and width.
    fields = 6

    def __init__(self, sub: _Call) -> None:
        assert sub.outer is not None
        self.outer = sub.outer
        self.sub = sub

    def pack(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This slice's updates as float32: one ``FIELDS`` record per row (``rows``
        records, the rest -1), and the computed rows' residuals and tails, in order."""
        meta = torch.full((rows, self.fields), -1.0, dtype=torch.float32)
        parts: list[torch.Tensor] = []
        position = {
            (id(slot.cache), slot.row): i
            for i, slot in enumerate(self.sub.slots)
            if slot is not None
        }
        for update in self.sub.updates:
            i = position[(id(update.cache), update.row)]
            meta[i, 0] = float(update.computed)
            meta[i, 1] = float(update.denoiser)
            meta[i, 2] = float(update.blocks)
            if update.computed:
                assert update.tail is not None
                if update.tail.dim() != 3:
                    raise RuntimeError(
                        f"step cache: a split exchanges [1, tokens, width] residuals, got"
                        f" {tuple(update.tail.shape)}"
                    )
                tokens, width = update.tail.shape[1], update.tail.shape[2]
                meta[i, 4], meta[i, 5] = float(tokens), float(width)
                if update.residual is not None:
                    meta[i, 3] = 1.0
                    parts.append(update.residual.reshape(-1).float())
                parts.append(update.tail.reshape(-1).float())
        payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)
        return meta, payload

    def merge(
        self, others: Sequence[tuple[int, torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> None:
        """Add this slice's updates and the other ranks' to the call: each other rank's
        ``(low, meta, payload)`` as its ``pack`` made them (on any device)."""
        self.outer.updates.extend(self.sub.updates)
        for low, meta, payload in others:
            offset = 0
            for i, record in enumerate(meta.tolist()):
                flag, denoiser, blocks, residual, tokens, width = record
                if flag < 0:
                    continue
                slot = self.outer.slots[low + i]
                assert slot is not None
                rows = slot.cache.row(int(denoiser), slot.row)
                update = _Update(
                    slot.cache,
                    slot.row,
                    rows,
                    computed=flag > 0,
                    blocks=int(blocks),
                    denoiser=int(denoiser),
                )
                if update.computed:
                    size = int(tokens) * int(width)
                    shape = (1, int(tokens), int(width))
                    if residual > 0:
                        update.residual = payload[offset : offset + size].reshape(shape).to(dtype)
                        offset += size
                    update.tail = payload[offset : offset + size].reshape(shape).to(dtype)
                    offset += size
                self.outer.updates.append(update)


#: What the tail does in a denoiser forward: every row computes (the blocks run as they
#: are), no row does (they pass the head's outputs on), or some do (sliced, scattered).
_ALL, _NONE, _SOME = "all", "none", "some"


@dataclass(eq=False, slots=True)
class _Forward:
    """One denoiser forward, from its head to its last block: what the tail blocks need."""

    rows: int
    mode: str
    #: The rows that compute, as a device index (``_SOME`` only).
    index: torch.Tensor | None = None
    #: The same rows on the host, as positions among the call's rows (``_SOME`` only).
    computing: list[int] | None = None
    #: The final hidden states of the skipping rows, in row order (``None``: none skips).
    skip_index: torch.Tensor | None = None
    skip_hidden: torch.Tensor | None = None
    #: The head's hidden states of the computing rows (their subset, or every row).
    head_hidden: torch.Tensor | None = None
    #: The updates that take the tail's residual, by position among computing rows.
    tails: list[tuple[int, _Update]] = field(default_factory=list)
    #: Per-row arguments already sliced for the computing rows, by id.
    sliced: dict[int, tuple[Any, Any]] = field(default_factory=dict)

    def rows_of(self, name: str, value: Any) -> Any:
        """A per-row argument's computing rows (one slice per call, shared by the blocks)."""
        if value is None:
            return None
        if isinstance(value, tuple):
            return tuple(self.rows_of(name, item) for item in value)
        if not isinstance(value, torch.Tensor):
            return value
        known = self.sliced.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        if value.shape[0] != self.rows:
            raise RuntimeError(
                f"step cache: the argument {name} has {value.shape[0]} rows where the model"
                f" call has {self.rows}"
            )
        assert self.index is not None
        sliced = value.index_select(0, self.index)
        self.sliced[id(value)] = (value, sliced)
        return sliced


# -- the blocks' forward ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Role:
    """What a wrapped block is: its spec, its denoiser and place."""

    spec: BlockSpec
    denoiser: int
    blocks: int
    head: bool
    last: bool


def _argument(spec: BlockSpec, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if name in kwargs:
        return kwargs[name]
    position = spec.params.index(name)
    return args[position] if position < len(args) else None


def _split(spec: BlockSpec, out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if spec.hidden_out is None:
        return out, None
    assert spec.encoder_out is not None
    return out[spec.hidden_out], out[spec.encoder_out]


def _packed(spec: BlockSpec, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    """Outputs in the block's own form: the hidden states, or the tuple."""
    if spec.hidden_out is None:
        return hidden
    assert spec.encoder_out is not None
    out: list[torch.Tensor | None] = [None, None]
    out[spec.hidden_out] = hidden
    out[spec.encoder_out] = encoder
    return tuple(out)


def _block_forward(
    role: _Role, module: torch.nn.Module, proceed: Any, *args: Any, **kwargs: Any
) -> Any:
    """A wrapped block's ``forward`` (``proceed``: the block's own): see the module doc."""
    forward = current()
    call: _Call | None = None if forward is None else forward.part(NAME)
    if call is None:
        return proceed(*args, **kwargs)
    if role.head:
        assert forward is not None
        return _head(call, forward, role, proceed, args, kwargs)
    run = call.forward
    if run is None or run.mode == _ALL:
        out = proceed(*args, **kwargs)
        if role.last and run is not None:
            _record_tails(role.spec, run, out)
            _set_forward(call, None)
        return out
    spec = role.spec
    if run.mode == _NONE:
        hidden = _argument(spec, "hidden_states", args, kwargs)
        encoder = _argument(spec, "encoder_hidden_states", args, kwargs)
        if role.last:
            _set_forward(call, None)
        return _packed(spec, hidden, encoder if spec.carries_encoder else None)
    sliced = list(args)
    for position, value in enumerate(args):
        name = spec.params[position]
        if name in spec.per_row:
            sliced[position] = run.rows_of(name, value)
    for name in spec.per_row.intersection(kwargs):
        kwargs[name] = run.rows_of(name, kwargs[name])
    out = proceed(*sliced, **kwargs)
    if not role.last:
        return out
    _set_forward(call, None)
    _record_tails(spec, run, out)
    return _scattered(spec, run, out)


def _record_tails(spec: BlockSpec, run: _Forward, out: Any) -> None:
    """The last block ran: each computing cached row's residual of the other blocks."""
    hidden, _ = _split(spec, out)
    head = run.head_hidden
    assert head is not None
    for position, update in run.tails:
        rows = slice(position, position + 1)
        update.tail = hidden[rows] - head[rows]


def _scattered(spec: BlockSpec, run: _Forward, out: Any) -> Any:
    """The last block's hidden states for every row, in row order (the encoder's: ``None``)."""
    hidden, _ = _split(spec, out)
    assert run.index is not None and run.skip_index is not None and run.skip_hidden is not None
    full = hidden.new_empty((run.rows, *hidden.shape[1:]))
    full.index_copy_(0, run.index, hidden)
    full.index_copy_(0, run.skip_index, run.skip_hidden)
    return _packed(spec, full, None)


def _head(
    call: _Call,
    forward: Forward,
    role: _Role,
    proceed: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The head block: run it for every row, decide per row, hand the tail its rows."""
    spec = role.spec
    slots = call.active
    for name in spec.unset:
        if _argument(spec, name, args, kwargs) is not None:
            raise RuntimeError(f"step cache: a block called with {name} is not covered")
    if not any(slot is not None for slot in slots):
        return proceed(*args, **kwargs)
    hidden_in = _argument(spec, "hidden_states", args, kwargs)
    out = proceed(*args, **kwargs)
    hidden, encoder = _split(spec, out)
    if hidden.shape[0] != len(slots):
        raise RuntimeError(
            f"step cache: the model call has {hidden.shape[0]} rows, its requests {len(slots)}"
        )
    updates = _decide(role, slots, hidden_in, hidden, forward.sums)
    call.updates.extend(update for update in updates if update is not None)
    computing = [i for i, update in enumerate(updates) if update is None or update.computed]
    if len(computing) == len(slots):
        # Every row computes: the tail runs as it is; only the residuals are kept.
        run = _Forward(rows=len(slots), mode=_ALL, head_hidden=hidden)
        run.tails = [(i, u) for i, u in enumerate(updates) if u is not None]
        _set_forward(call, run)
        return out
    computes = set(computing)
    skipping = [i for i in range(len(slots)) if i not in computes]
    skip_hidden = _skip_hidden(skipping, updates, hidden)
    if not computing:
        # Every row skips: the head's outputs are final, the tail passes them on.
        _set_forward(call, _Forward(rows=len(slots), mode=_NONE))
        return _packed(spec, skip_hidden, encoder)
    device = hidden.device
    index = torch.tensor(computing, device=device, dtype=torch.long)
    run = _Forward(
        rows=len(slots),
        mode=_SOME,
        index=index,
        computing=computing,
        skip_index=torch.tensor(skipping, device=device, dtype=torch.long),
        skip_hidden=skip_hidden,
    )
    _set_forward(call, run)
    run.head_hidden = hidden.index_select(0, index)
    head_encoder = None if encoder is None else encoder.index_select(0, index)
    run.tails = [
        (position, update)
        for position, i in enumerate(computing)
        if (update := updates[i]) is not None
    ]
    return _packed(spec, run.head_hidden, head_encoder)


def _skip_hidden(
    skipping: list[int], updates: list[_Update | None], hidden: torch.Tensor
) -> torch.Tensor:
    """The skipping rows' final hidden states: the head's plus the rest's cached residual."""
    finals: list[torch.Tensor] = []
    for i in skipping:
        update = updates[i]
        assert update is not None
        rows = update.rows
        # A row skips only once it has computed: its tail is there.
        taylor = update.cache.policy.kind == "taylorseer"
        tail = _forecast(rows) if taylor else rows.tensors["tail"]
        # ``tail + head``, as diffusers adds them (the same bits either way round).
        finals.append(tail + hidden[i : i + 1])
    return finals[0] if len(finals) == 1 else torch.cat(finals)


def _decide(
    role: _Role,
    slots: list[_Slot | None],
    hidden_in: torch.Tensor,
    hidden: torch.Tensor,
    reduce: Any,
) -> list[_Update | None]:
    """Each row's update (``None``: no policy), its decision made; one host sync at most.

    ``reduce``: the group's sums of a call whose tokens are split over ranks
    (``Forward.sums``), or ``None``.
    """
    updates: list[_Update | None] = []
    ratios: list[torch.Tensor] = []
    pending: list[_Update] = []
    for i, slot in enumerate(slots):
        if slot is None:
            updates.append(None)
            continue
        cache = slot.cache
        rows = cache.row(role.denoiser, slot.row)
        update = _Update(
            cache, slot.row, rows, computed=True, blocks=role.blocks, denoiser=role.denoiser
        )
        updates.append(update)
        policy = cache.policy
        if policy.kind == "taylorseer":
            update.computed = _taylor_computes(policy, rows)
            continue
        one = slice(i, i + 1)
        update.residual = residual = hidden[one] - hidden_in[one]
        previous = rows.tensors.get("residual")
        if (
            rows.calls < (policy.warmup or 1)
            or previous is None
            or "tail" not in rows.tensors
            or (policy.max_consecutive is not None and rows.run >= policy.max_consecutive)
        ):
            continue
        if reduce is None:
            # As diffusers' FirstBlockCache for one row: the same operations and shapes.
            ratios.append((residual - previous).abs().mean() / previous.abs().mean())
        else:
            # A slice of the row's tokens: its sums, for the group's (``token_split``).
            sums = ((residual - previous).abs().sum(), previous.abs().sum())
            ratios.append(torch.stack(sums).float())
        pending.append(update)
    if pending:
        values: list[float]
        if reduce is not None:
            total = reduce(torch.stack(ratios))
            values = (total[:, 0] / total[:, 1]).tolist()
        elif len(ratios) == 1:
            # One host sync for every row of the call (``.item()`` for a lone one).
            values = [ratios[0].item()]
        else:
            values = torch.stack(ratios).tolist()
        for update, ratio in zip(pending, values, strict=True):
            threshold = update.cache.threshold
            assert threshold is not None
            # Skip when below: a NaN ratio (a zero residual) computes, and 0 never skips.
            update.computed = not ratio < threshold
    return updates


def _taylor_computes(policy: StepCache, rows: RowCache) -> bool:
    """TaylorSeer's schedule: the warm-up, then one call in ``interval``."""
    warmup, interval = policy.warmup or 1, policy.interval or 1
    if rows.calls < warmup or "tail" not in rows.tensors:
        return True
    return (rows.calls - warmup + 1) % interval == 0


# -- installing the wrappers ------------------------------------------------------------


class BlockCache:
    """A runner's step cache: the blocks' wrappers, and its part of each model call.

    ``layout`` is the runner's family (the step cache sits below the families: a
    request's state holds its cache, so it asks no registry).
    """

    def __init__(self, pipe: Any, hooks: ModuleHooks, layout: BlockLayout) -> None:
        found = denoiser_blocks(pipe, layout)
        #: The kinds the runner declares (``RunnerCapabilities.step_cache``).
        self.kinds: frozenset[str] = frozenset() if not found else KINDS
        self._hooks = hooks
        for denoiser, blocks in enumerate(found or ()):
            for index, block in enumerate(blocks):
                spec = spec_of(block, layout.block_specs)
                assert spec is not None
                last = index == len(blocks) - 1
                role = _Role(spec, denoiser, len(blocks), head=index == 0, last=last)
                hooks.wrap(block, NAME, functools.partial(_block_forward, role))

    @property
    def count(self) -> int:
        """How many blocks this runner holds wrapped (0 once its hooks are closed)."""
        return len(self._hooks.modules(NAME))

    def part(self, call: ModelCall) -> _Call | None:
        """The step cache's part of ``call`` (``None``: no row of it is cached).

        Its updates are committed when the call returns normally only.
        """
        slots: list[_Slot | None] = []
        cached = False
        for state, _, count in call.owners():
            cache: RequestCache | None = state.cache
            if cache is None:
                slots.extend([None] * count)
                continue
            if cache.rows != count:
                raise RuntimeError(f"step cache: {count} rows where the request has {cache.rows}")
            cached = True
            slots.extend(_Slot(cache, row) for row in range(count))
        return _Call(slots) if cached else None


def wrapped(block: torch.nn.Module) -> bool:
    """Whether ``block``'s forward is the step cache's now."""
    return has_hook(block, NAME)
