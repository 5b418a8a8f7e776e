"""The layers, read from the source: which module may import which.

omni_trio is layered (docs/design.md, "Layers"): the data and the seam at the bottom;
the thread side (the step loop, the pool, the materializer) beside the loop side (the
engine, its records and handles), which never meet but through messages; the runners
on the seam only, the parallel runner on the runners; ``serve`` on the library; the
command line on top of everything. These tests read every import of every module
(module level, inside functions, and under ``TYPE_CHECKING``: a type-only import is a
dependency of the reader too) and fail naming the import that crosses a line. No
module is imported, so they are fast and cannot be fooled by what an import happens
to pull in.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omni_trio"

#: The event loop's libraries: the thread side never imports them.
EVENT_LOOP = ("anyio", "trio", "asyncio", "sniffio")

#: The loop side: runs in the event loop's thread only.
LOOP_SIDE = (
    "_open",
    "_engine",
    "_ledger",
    "_weightops",
    "_runner_adapters",
    "_resultstore",
    "_record",
    "_handle",
    "_owner",
    "_channel",
    "_deadlines",
    "_inbox",
)

#: The thread side: runs in the engine's own threads only, and posts messages.
THREAD_SIDE = (
    "_worker",
    "_parking",
    "_suspend",
    "_checkpointing",
    "_wholecall",
    "_pool",
    "_materialize",
    "_imagecheck",
    "_failure",
    "_scheduler",
    "_queue",
    "_stepsums",
    "_fairshare",
    "_workitem",
    "_messages",
    "_cancelpoint",
    "_cacheplan",
    "_steptimes",
)

#: What a runner may import of the core: the seam and the data it carries.
RUNNER_SEAM = frozenset(
    {
        "omni_trio.abc",
        "omni_trio._runner",
        "omni_trio._cancelpoint",
        "omni_trio._request",
        "omni_trio._errors",
        "omni_trio._exports",
        # The step-cache policy a request carries and the metrics a runner reports
        # (L80, L84): data, torch-free, as the request is.
        "omni_trio._stepcache",
        # The adapters a request names and what a runner reports of them (L85).
        "omni_trio._adapters",
        # A checkpoint's envelope and its error (L78): data, torch-free.
        "omni_trio._checkpoint",
        # A request to plain data and back (a parallel plan's join): data, as it is.
        "omni_trio._codec",
        # Weights in place and sleep (L102, L103): the source, the bytes, the error.
        "omni_trio._weights",
        # A request's stochastic sampler and the trajectory a runner returns (L100): data,
        # torch-free, as the request is.
        "omni_trio._sampling",
    }
)

#: Each endpoint's modules (a package: all of its modules): siblings over the serving
#: plumbing (``_asgi``, ``_forms``, ...).
ENDPOINTS = {
    "images": ["_images"],
    "edits": ["_edits"],
    "videos": ["_videos", "_video_body", "jobs"],
    "files": ["_files"],
}

#: The video jobs' package: its stores below, its lifecycle above (its docstring).
JOBS = PACKAGE / "serve" / "jobs"
#: The stores' modules: they block (called off the loop) and know nothing of the lifecycle.
JOB_STORES = ("_store", "_files", "_sqlite", "_memory", "_pg_session", "_postgres", "_writer")
#: The lifecycle's modules: in the event loop, over the stores' protocol.
JOB_LIFECYCLE = ("_record", "_job", "_table", "_runs", "_leases", "_jobs")


def module_name(path: Path) -> str:
    """``omni_trio/serve/_app.py`` -> ``omni_trio.serve._app`` (a package: its name)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[Path]:
    """Every module of the package."""
    return sorted(PACKAGE.rglob("*.py"))


def is_module(name: str) -> bool:
    """Whether ``name`` (``omni_trio.x.y``) is a module or package of this project."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@cache
def imports(path: Path, *, type_only: bool = True) -> frozenset[tuple[str, str | None]]:
    """``(module, name)`` for every import in ``path``: ``name`` is ``None`` for ``import m``.

    Relative imports are made absolute; ``from m import x`` where ``m.x`` is a module
    gives ``(m.x, None)`` too. ``type_only=False`` leaves out the imports under ``if
    TYPE_CHECKING:``, which never run.
    """
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    if not type_only:
        skipped = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for inner in ast.walk(node)
        }
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = ".".join(filter(None, [base, node.module]))
            else:
                assert node.module is not None
                module = node.module
            found.add((module, None))
            for alias in node.names:
                if is_module(f"{module}.{alias.name}"):
                    found.add((f"{module}.{alias.name}", None))
                else:
                    found.add((module, alias.name))
    return frozenset(found)


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports."""
    return {module for module, _ in imports(path)}


def crossing(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    """The modules ``path`` imports that are, or are inside, one of ``forbidden``."""
    return sorted(
        module
        for module in imported_modules(path)
        if any(module == top or module.startswith(f"{top}.") for top in forbidden)
    )


def core(name: str) -> Path:
    return PACKAGE / f"{name}.py"


def test_the_import_reader_sees_what_it_must() -> None:
    """The reader resolves relative imports, names and modules (so the rules can fail)."""
    worker = imports(core("_worker"))
    assert ("omni_trio._scheduler", None) in worker
    assert ("omni_trio._runner", "StopRun") in worker
    assert ("omni_trio._exports", None) in imports(PACKAGE / "serve" / "__init__.py")
    assert crossing(core("_inbox"), EVENT_LOOP)  # the hand-off does touch the loop


@pytest.mark.parametrize("name", THREAD_SIDE)
def test_the_thread_side_imports_no_event_loop(name: str) -> None:
    """The step loop's modules never import an event loop nor the loop side (L20)."""
    assert not crossing(core(name), EVENT_LOOP), name
    assert not crossing(core(name), tuple(f"omni_trio.{m}" for m in LOOP_SIDE)), name


#: The pure modules: the waiting queue, its step sums, fair share and the boundary policy.
PURE = ("_scheduler", "_queue", "_stepsums", "_fairshare", "_steptimes")


@pytest.mark.parametrize("name", PURE)
def test_the_scheduler_is_pure(name: str) -> None:
    """The scheduler's modules import no threads, no event loop, and of omni_trio only
    each other: plain data in, a plan out, testable without an engine."""
    own = {m for m in imported_modules(core(name)) if m.startswith("omni_trio")}
    assert own <= {f"omni_trio.{pure}" for pure in PURE}, own
    assert not crossing(core(name), ("threading", *EVENT_LOOP)), name


def test_the_handle_reaches_the_engine_only_through_its_seam() -> None:
    """``_handle`` never imports ``_engine`` (not even for typing): it has ``RequestOwner``."""
    assert "omni_trio._owner" in imported_modules(core("_handle"))
    assert not crossing(core("_handle"), ("omni_trio._engine",))


def runner_modules() -> Iterator[Path]:
    return (PACKAGE / "runners").glob("*.py")


@pytest.mark.parametrize("path", sorted(runner_modules()), ids=lambda p: p.name)
def test_runners_import_only_the_core_seam(path: Path) -> None:
    """A runner knows the seam (``abc``, the request, ``cancel_point``), never the engine."""
    core_imports = {
        module
        for module in imported_modules(path)
        if module.startswith("omni_trio.") and not module.startswith("omni_trio.runners")
    }
    assert core_imports <= RUNNER_SEAM, sorted(core_imports - RUNNER_SEAM)


def parallel_modules() -> Iterator[Path]:
    return (PACKAGE / "parallel").glob("*.py")


@pytest.mark.parametrize("path", sorted(parallel_modules()), ids=lambda p: p.name)
def test_the_parallel_runner_imports_only_the_runners_and_the_core_seam(path: Path) -> None:
    """``omni_trio.parallel`` is a runner over runners: the seam and ``runners``, never the
    engine's modules, ``serve`` or ``cli``."""
    core_imports = {
        module
        for module in imported_modules(path)
        if module.startswith("omni_trio.")
        and not module.startswith(("omni_trio.parallel", "omni_trio.runners"))
    }
    assert core_imports <= RUNNER_SEAM, sorted(core_imports - RUNNER_SEAM)


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "parallel").glob("*.py")), ids=lambda path: path.name
)
def test_the_parallel_runner_reads_the_runners_public_names_only(path: Path) -> None:
    """``omni_trio.parallel`` imports ``omni_trio.runners``' public names, never a private
    module of it: the model call's room (``rows_slice``, ``token_split``, ``Exchange``) is
    how a rank tells the call's features what it runs, and runs what they declare."""
    private = sorted(m for m in imported_modules(path) if m.startswith("omni_trio.runners._"))
    assert not private, private


#: The per-row features of a model call and its hooks: each reads the call's context
#: (``runners._forward``) and holds its hooks in ``runners._hooks``, never another's.
MODEL_CALL_FEATURES = ("_stepcache", "_adapters", "_cancel")


@pytest.mark.parametrize("feature", MODEL_CALL_FEATURES)
def test_the_model_calls_features_read_the_context_not_each_other(feature: str) -> None:
    """A feature of the model call imports the context and the hook registry, never
    another feature (the adapters read which rows compute from the context, not from the
    step cache)."""
    imported = imported_modules(PACKAGE / "runners" / f"{feature}.py")
    others = {f"omni_trio.runners.{other}" for other in MODEL_CALL_FEATURES} - {
        f"omni_trio.runners.{feature}"
    }
    assert not imported & others, sorted(imported & others)
    assert "omni_trio.runners._hooks" in imported


@pytest.mark.parametrize(
    "package",
    [
        "omni_trio._",
        "omni_trio.abc",
        "omni_trio.runners",
        "omni_trio.parallel",
        "omni_trio.testing",
    ],
)
def test_the_library_never_imports_the_server_or_the_command_line(package: str) -> None:
    """The core, the seam, the runners and the test kit import neither ``serve`` nor ``cli``.

    ``python -m omni_trio`` (``omni_trio/__main__.py``) is the command line's shim.
    """
    for path in modules():
        name = module_name(path)
        if name.startswith(package) and name != "omni_trio.__main__":
            assert not crossing(path, ("omni_trio.serve", "omni_trio.cli")), path


def test_serve_never_imports_the_command_line() -> None:
    """``serve`` is a library: the command line (argparse, options) sits on top of it."""
    for path in (PACKAGE / "serve").rglob("*.py"):
        assert not crossing(path, ("omni_trio.cli", "argparse")), path


def endpoint_paths(names: list[str]) -> list[Path]:
    """The files of an endpoint's modules and packages."""
    folders = [PACKAGE / "serve" / name for name in names]
    return [
        path
        for folder in folders
        for path in (
            sorted(folder.glob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
        )
    ]


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_endpoints_import_neither_their_app_nor_each_other(endpoint: str) -> None:
    """An endpoint never imports ``serve/_app`` or another endpoint, not even for typing."""
    siblings = [
        f"omni_trio.serve.{module}"
        for other, names in ENDPOINTS.items()
        if other != endpoint
        for module in names
    ]
    forbidden = ("omni_trio.serve._app", *siblings)
    paths = endpoint_paths(ENDPOINTS[endpoint])
    assert all(path.is_file() for path in paths), paths
    # The resolution works: each endpoint reaches the plumbing's errors.
    assert any("omni_trio.serve._errors" in imported_modules(path) for path in paths)
    for path in paths:
        assert not crossing(path, forbidden), (path, crossing(path, forbidden))


def test_the_jobs_lifecycle_talks_to_the_store_protocol_only() -> None:
    """The video jobs' lifecycle imports ``_store``'s protocols, never a store's module: only
    ``_job`` (``store_of``, the one place that makes a ``SqliteJobStore`` of ``jobs_dir``)
    imports ``_sqlite``, and the package's ``__init__`` re-exports the stores; so a new store
    (PostgreSQL) changes no module of the lifecycle but that one."""
    assert sorted(p.stem for p in JOBS.glob("*.py")) == sorted(
        ("__init__", *JOB_STORES, *JOB_LIFECYCLE)
    )
    stores = {
        f"omni_trio.serve.jobs.{m}"
        for m in ("_sqlite", "_memory", "_files", "_pg_session", "_postgres")
    }
    allowed = {
        "__init__": stores,
        "_job": {"omni_trio.serve.jobs._sqlite"},
        "_sqlite": {"omni_trio.serve.jobs._files"},
        "_postgres": {"omni_trio.serve.jobs._pg_session"},
    }
    for name in ("_jobs", "_runs", "_leases"):
        assert "omni_trio.serve.jobs._store" in imported_modules(JOBS / f"{name}.py"), name
    for path in JOBS.glob("*.py"):
        found = imported_modules(path) & stores
        assert found <= allowed.get(path.stem, set()), (path.stem, sorted(found))


@pytest.mark.parametrize("name", JOB_STORES)
def test_the_job_stores_block_and_know_nothing_of_the_lifecycle(name: str) -> None:
    """A store's module imports no event loop (its methods block, called off the loop)
    and, of omni_trio, only the other stores' modules and the checkpoint's data."""
    path = JOBS / f"{name}.py"
    assert not crossing(path, EVENT_LOOP), name
    own = {m for m in imported_modules(path) if m.startswith("omni_trio")}
    allowed = {f"omni_trio.serve.jobs.{m}" for m in JOB_STORES} | {"omni_trio._checkpoint"}
    assert own <= allowed, (name, sorted(own - allowed))


def test_the_lease_keeper_never_reaches_into_the_lifecycle() -> None:
    """``_leases`` knows the shared store's protocol and its ``Holder``, never the modules
    of the jobs it keeps the leases of: it tells the lifecycle what it lost or took over."""
    lifecycle = tuple(f"omni_trio.serve.jobs.{m}" for m in ("_job", "_table", "_runs", "_jobs"))
    assert not crossing(JOBS / "_leases.py", lifecycle)


def test_nothing_imports_another_modules_underscore_names() -> None:
    """A private name stays in its module: ``from m import _x`` only for a module ``_x``."""
    private = [
        f"{module_name(path)}: from {module} import {name}"
        for path in modules()
        for module, name in imports(path)
        if name is not None and name.startswith("_") and not name.startswith("__")
    ]
    assert not private, private


def test_no_module_imports_itself_back_when_it_runs() -> None:
    """No import cycle: no module reaches itself through the imports that run (those under
    ``TYPE_CHECKING`` never do; a package's ``__init__``, which imports its modules, is
    left out: a module may read its package's version from it, inside a function)."""
    packages = {module_name(path) for path in modules() if path.name == "__init__.py"}
    graph = {
        module_name(path): {m for m, _ in imports(path, type_only=False)} - packages
        for path in modules()
        if path.name != "__init__.py"
    }
    cycles = []
    for start in graph:
        seen: set[str] = set()
        frontier = set(graph[start])
        while frontier:
            if start in frontier:
                cycles.append(start)
                break
            seen |= frontier
            frontier = {m for f in frontier for m in graph.get(f, ())} - seen
    assert not cycles, cycles


def _packages() -> list[Path]:
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_is_named_in_its_packages_layout_note(package: Path) -> None:
    """A package's docstring names every module in it (the layout a newcomer reads first):
    a module added without its line, or renamed, fails here."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = sorted(path.stem for path in package.glob("*.py") if path.stem != "__init__")
    unnamed = [name for name in modules if f"``{name}``" not in doc and f"`{name}`" not in doc]
    assert not unnamed, f"{package.name}'s docstring does not name {unnamed}"
