"""The ``omni-trio`` command line (also ``python -m omni_trio``): demo, serve, load.

The library never imports this package; it imports the library (``serve`` for the
server, the core for the demo). Its modules:

- ``_main``: ``main()``: the parser, the commands that need the ``serve`` extra
  (imported only once it is there), one-line errors, ``--version``, ``--debug``.
- ``_errors``: ``UsageError`` and ``CommandError``, the exit statuses, ``summary``,
  and ``reported``: a command run with its errors printed as one line each.
- ``_demo``: ``demo``: one image with a tiny model (or a model spec's), a progress bar.
- ``_types``: the argparse value types of every command.
- ``_given``: which options the command line gave, and the refusal of those that
  do not apply (``--replicas`` without ``--ray``), or, from their variable, the
  note that they are ignored.
- ``_declare``: an option declared once (``Option``: its spellings, type, default,
  help, section, where it applies, the field it sets), and the argparse arguments
  and the dataclass fields made of a table of them.
- ``_serve_table``: ``serve``'s table: every option of the command, in ``--help``'s order.
- ``_spec_table``: the model spec's options (``--dtype``, ``--compile``, ...), declared
  once for ``serve``'s table and ``demo``, torch-free and without the serve extra.
- ``_serve_groups``: what the table is made of besides its options: ``Applies`` (where
  an option applies), ``--help``'s sections, the actions and types only it uses.
- ``_serve``: ``serve``: its options (the table's), checked before it serves, then
  the service.
- ``_options``: ``serve``'s options as the serve package's ``ServiceOptions``, the
  options that do not apply to a run, and the serve package's errors as the
  command's, named by their option.
- ``_servers``: the service under Hypercorn (trio) or Uvicorn (asyncio), drained on
  SIGTERM or SIGINT.
- ``_ray``: ``serve --ray``: the same service, N replicas on Ray Serve, Ray in a
  child process of a session of its own (a SIGTERM to the process group reaches
  the command only, which relays it).
- ``_env``: every ``serve`` option from its ``OMNI_TRIO_<OPTION>`` variable.
- ``_logs``: the server's log on stderr, as text or JSON lines.
- ``_access``: Hypercorn's access log without its phantom lines.
- ``_sockets``: the port checked before serving, the connections still open after
  the drain aborted.
- ``_loadtest_command``: ``load``: an open-loop load test of an images endpoint;
  ``_loadtest``: its HTTP client; ``_loadtest_math``: its schedule and figures (pure).
"""

from __future__ import annotations

from ._main import main as main

__all__ = ["main"]
