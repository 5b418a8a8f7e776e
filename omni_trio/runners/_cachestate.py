"""What the step cache knows before a model call (L80-L84): how a family's blocks are
called (``BlockSpec``, ``BlockLayout``, ``denoiser_blocks``) and each request's state
(``RequestCache``: its policy, one ``RowCache`` per row and denoiser, its counts).

``_stepcache`` reads them inside the model calls; a family declares its ``BlockSpec``s
(``_family``), and the runner makes, parks and drops a request's ``RequestCache`` with
its state (L82).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._request import GenerationRequest
from .._stepcache import CacheMetrics, StepCache

__all__ = [
    "BlockLayout",
    "BlockSpec",
    "RequestCache",
    "RowCache",
    "denoiser_blocks",
    "spec_of",
]


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """How a block class is called and what it returns.

    ``params``: its ``forward``'s parameters, in order (positional arguments are
    named by them). ``hidden_out``/``encoder_out``: where the hidden and the encoder
    hidden states are in the tuple it returns (``hidden_out`` ``None``: it returns
    the hidden states alone, and the encoder hidden states, if it takes them, are an
    input of every block, not carried). ``per_row``: the other arguments with one row
    per row of the call (sliced for the rows that compute); the rest are shared.
    ``unset``: arguments that must be ``None`` (a variant the table does not cover).
    A family's specs (``block_specs``) are checked against the installed diffusers'
    signatures at construction: a class whose ``forward`` differs is not wrapped (no
    step cache).
    """

    params: tuple[str, ...]
    hidden_out: int | None
    encoder_out: int | None
    per_row: frozenset[str]
    unset: frozenset[str] = frozenset()

    @property
    def carries_encoder(self) -> bool:
        return self.encoder_out is not None


class BlockLayout(Protocol):
    """What the step cache reads of a family (``_family.Family``'s facts): where its
    denoisers and their blocks are, and how each of its block classes is called."""

    @property
    def denoisers(self) -> tuple[str, ...]: ...

    @property
    def block_lists(self) -> tuple[str, ...]: ...

    @property
    def block_specs(self) -> Mapping[str, BlockSpec]: ...


def spec_of(block: torch.nn.Module, specs: Mapping[str, BlockSpec]) -> BlockSpec | None:
    """The block's spec, if its class is known and its ``forward`` takes what it says."""
    spec = specs.get(type(block).__name__)
    if spec is None:
        return None
    params = tuple(inspect.signature(type(block).forward).parameters)[1:]
    return spec if params == spec.params else None


def denoiser_blocks(pipe: Any, layout: BlockLayout) -> list[list[torch.nn.Module]] | None:
    """Each DiT denoiser's blocks in call order; ``None`` if a denoiser cannot be cached.

    A denoiser can be cached when every block is of a class its family's
    ``block_specs`` know and it has at least two blocks (a head and a tail to skip).
    Empty for a family without specs (a UNet).
    """
    if not layout.block_specs:
        return []
    found: list[list[torch.nn.Module]] = []
    for name in layout.denoisers:
        denoiser = getattr(pipe, name, None)
        if not isinstance(denoiser, torch.nn.Module):
            continue
        if getattr(denoiser, "zero_cond_t", False):
            return None  # Qwen-Image-Edit's doubled timestep rows: not covered
        blocks = [
            block
            for child, module in denoiser.named_children()
            if child in layout.block_lists and isinstance(module, torch.nn.ModuleList)
            for block in module
        ]
        if len(blocks) < 2 or any(spec_of(block, layout.block_specs) is None for block in blocks):
            return None
        found.append(blocks)
    return found


# -- per-request state ------------------------------------------------------------------


class RowCache:
    """One row's cache on one denoiser: tensors (parked with the state) and counters.

    ``tensors``: ``residual`` (the head's residual of the last computed call,
    first-block), ``tail`` (the other blocks' residual of the hidden states at the
    last computed call), and for taylorseer its finite differences ``tail_1`` and
    ``tail_2``.
    ``calls``: model calls the row made on this denoiser; ``run``: skipped in a row;
    ``computed_at``: the call index of the last computed call.
    """

    __slots__ = ("calls", "computed_at", "run", "tensors")

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.run = 0
        self.computed_at = -1


@dataclass(eq=False)
class RequestCache:
    """A request's step cache: its policy, each row's caches, what it did (L82, L84)."""

    policy: StepCache
    rows: int
    threshold: float | None
    loosened: bool = False
    #: Denoiser index -> one ``RowCache`` per row.
    experts: dict[int, list[RowCache]] = field(default_factory=dict)
    calls_computed: int = 0
    calls_skipped: int = 0
    blocks_computed: int = 0
    blocks_skipped: int = 0
    #: Per row, one character per model call: C computed, S skipped.
    pattern: list[list[str]] = field(default_factory=list)

    @classmethod
    def create(cls, request: GenerationRequest, rows: int) -> RequestCache | None:
        """The cache of a request with ``rows`` rows per model call; ``None`` without policy."""
        policy = request.cache
        if policy is None or not policy.skips:
            return None
        return cls(policy, rows, policy.threshold, pattern=[[] for _ in range(rows)])

    def row(self, denoiser: int, row: int) -> RowCache:
        rows = self.experts.get(denoiser)
        if rows is None:
            rows = self.experts[denoiser] = [RowCache() for _ in range(self.rows)]
        return rows[row]

    def holders(self) -> Iterator[dict[str, torch.Tensor]]:
        """The dictionaries of this cache's tensors (to count and to park them, L82)."""
        for rows in self.experts.values():
            for row in rows:
                yield row.tensors

    def metrics(self) -> CacheMetrics:
        """What it did so far."""
        return CacheMetrics(
            kind=self.policy.kind,
            calls_computed=self.calls_computed,
            calls_skipped=self.calls_skipped,
            blocks_computed=self.blocks_computed,
            blocks_skipped=self.blocks_skipped,
            threshold=self.threshold,
            loosened=self.loosened,
            pattern=tuple("".join(calls) for calls in self.pattern),
        )
