"""What ``serve``'s option table (``_serve_table``) is made of besides its options: where
an option applies (``Applies``), the sections of ``--help`` (the groups), and the
actions and value types only the table uses.
"""

from __future__ import annotations

import argparse
import enum

from ._declare import Group

__all__ = [
    "ADAPTERS",
    "DECODING",
    "DEFAULTS",
    "DEVICES",
    "KEYS",
    "LIMITS",
    "LOGS",
    "MODEL",
    "OUTPUTS",
    "RANKS",
    "RAY",
    "VIDEOS",
    "AppendKeys",
    "Applies",
    "names",
]


class Applies(enum.Enum):
    """Where an option applies; each value is what a refusal says (``Unused.reason``).

    ``_options`` decides each: the first four from the arguments, before anything
    loads; the others from the model, once it loaded. An option that does not apply
    is refused in this order, then in the table's.
    """

    RAY = "applies with --ray only"
    NOT_RAY = "does not apply with --ray (Ray Serve's proxy serves HTTP)"
    FAKE = "applies to --model fake only"
    REAL = "applies to a real model (the fake one's step is --step-seconds)"
    ADAPTERS = "applies to models that take adapters (diffusers pipelines with LoRA loading)"
    VIDEO = "applies to video models only (Wan, LTX-Video)"
    VAE = (
        "applies to models whose VAE omni_trio drives (not fake, an unconditional UNet or a"
        " pipeline served by its own call)"
    )
    LTX = "applies to LTX-Video models only"


class AppendKeys(argparse.Action):
    """``append``, where the command line replaces a default from the environment.

    argparse's own ``append`` would append to the variable's value (``_env``): the
    command line wins, as for every other option.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(given if isinstance(given, list) else ()), values])


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (``transformer,text_encoder_2``)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected names, comma-separated")
    return names


MODEL = Group(title="the model's precision and speed (L89-L92)")
DEVICES = Group(title="devices (one worker each, one queue)")
RANKS = Group(
    title="several ranks on one request (one worker, N processes: faster requests, not more)"
)
LIMITS = Group(title="engine and limits")
VIDEOS = Group(title="video jobs (a video model's /v1/videos)")
DECODING = Group(title="decodes in chunks (L72: an abort during a decode lands within one chunk)")
DEFAULTS = Group(title="request defaults (by default: what suits the model)")
ADAPTERS = Group(title="adapters (LoRA, L85-L88)")
OUTPUTS = Group(
    title='outputs as URLs (L97: response_format "url", a signed URL of GET /v1/files/KEY)'
)
KEYS = Group(title="API keys and tenants (with any key, every route but /health needs one)")
LOGS = Group(title="logging (stderr) and traces")
RAY = Group(
    title="Ray Serve (scale out; needs the ray extra; --server and --close-timeout do not apply)"
)
