"""The package's version, written once: ``omni_trio.__version__`` and pyproject.toml read it.

A module of its own, so that a module of the package that needs the version (a
checkpoint's envelope, the command line's ``--version``) imports it without importing
the package's ``__init__``: no import cycle.
"""

__version__ = "0.2.0"
