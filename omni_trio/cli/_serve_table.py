"""``serve``'s options, each declared once (``_declare.Option``), in ``--help``'s order.

Each option that sets a field of ``ServiceOptions`` names it (``sets``); the
others the command reads itself (``--host``, ``--ray``), or a function of
``_options`` builds their field from several (``devices`` from ``--devices`` or
``--workers``). From this table come the parser (``_serve.add_serve_arguments``),
the variables (``_env``), the ``ServiceOptions`` of the parsed arguments and the
options that do not apply to a run (``_options``); docs/serving.md's options table
lists them in this order (tests/cli/test_docs.py).

A new option is one entry here: its flag, the field it sets, its type (``_types``),
its help, and its default if not the field's. The model spec's options (``--revision``
to ``--gguf-file``) are ``_spec_table``'s, which ``demo`` shares.
"""

from __future__ import annotations

from .._config import EngineConfig
from .._request import MAX_PRIORITY
from ..serve._models import MODELS
from ..serve.jobs import DEFAULT_JOBS_LEASE_S, default_jobs_dir
from ._declare import Option
from ._logs import LOG_FORMATS
from ._serve_groups import (
    ADAPTERS,
    DECODING,
    DEFAULTS,
    DEVICES,
    KEYS,
    LIMITS,
    LOGS,
    OUTPUTS,
    RANKS,
    RAY,
    VIDEOS,
    AppendKeys,
    Applies,
)
from ._spec_table import SPEC_OPTIONS
from ._types import (
    adapter,
    api_keys,
    bound,
    count,
    finite,
    gpus,
    interval,
    jobs_dir,
    positive,
    result_cache,
    seconds,
    size,
    sizes,
    step_cache,
    threshold,
)

__all__ = ["SERVE_OPTIONS", "SPLIT_BY_LOAD", "Applies"]


#: The option that turns a token split off while the queue is deep (``by_load``).
SPLIT_BY_LOAD = "--split-by-load"

_MAX_STEP_S = EngineConfig().max_step_s

SERVE_OPTIONS = (
    Option(
        flag="--model",
        sets="model",
        required=True,
        metavar="MODEL|PATH|ORG/NAME",
        help=f"one of {', '.join(MODELS)}, a local diffusers folder, or a Hugging Face hub"
        " id (from the cache with HF_HUB_OFFLINE=1)",
    ),
    Option(flag="--model-name", sets="model_name", help="the id in /v1/models"),
    *SPEC_OPTIONS,
    Option(flag="--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)"),
    Option(
        flag="--port",
        type=count(0, 65535),
        default=8000,
        help="port; 0 picks a free one (default 8000)",
    ),
    Option(
        flag="--server",
        choices=["hypercorn", "uvicorn"],
        default="hypercorn",
        applies=Applies.NOT_RAY,
        help="hypercorn runs on trio (default), uvicorn on asyncio",
    ),
    Option(
        flag="--devices",
        sets="devices",
        group=DEVICES,
        exclusive=True,
        metavar="LIST|auto",
        help="torch devices, comma-separated (cuda:0,cuda:1), or auto: every visible GPU,"
        " else the CPU (default: one worker where the model loads)",
    ),
    Option(
        flag="--workers",
        sets="devices",
        group=DEVICES,
        exclusive=True,
        type=count(1, 64),
        metavar="N",
        help="N workers on the CPU, torch's threads shared out among them",
    ),
    Option(
        flag="--cfg-parallel",
        sets="parallel",
        group=RANKS,
        exclusive=True,
        type=count(2, 64),
        metavar="N",
        help="split each request's classifier-free guidance (its two halves) over N ranks",
    ),
    Option(
        flag="--ulysses",
        sets="parallel",
        group=RANKS,
        exclusive=True,
        type=count(2, 64),
        metavar="N",
        help="split each model call's tokens, Ulysses attention (DiT models) over N ranks",
    ),
    Option(
        flag="--ring",
        sets="parallel",
        group=RANKS,
        exclusive=True,
        type=count(2, 64),
        metavar="N",
        help="split each model call's tokens, ring attention (DiT models) over N ranks",
    ),
    Option(
        flag=SPLIT_BY_LOAD,
        sets="split_by_load",
        group=RANKS,
        action="store_true",
        help="with --ulysses or --ring: split one request while the batch is smaller than"
        " the ranks, run the batch's rows on their own ranks when it is not",
    ),
    Option(
        flag="--max-batch-size",
        sets="engine_config.max_batch_size",
        group=LIMITS,
        type=count(1),
        help="requests per denoise step (default 4)",
    ),
    Option(
        flag="--max-waiting",
        sets="engine_config.max_waiting",
        group=LIMITS,
        type=count(0),
        default=256,
        help="queue bound, then 429 (default 256)",
    ),
    Option(
        flag="--shutdown-grace",
        sets="engine_config.shutdown_grace",
        group=LIMITS,
        type=seconds,
        default=10.0,
        metavar="S",
        help="seconds running requests get to finish on shutdown (default 10)",
    ),
    Option(
        flag="--stop-timeout",
        sets="engine_config.stop_timeout_s",
        group=LIMITS,
        type=seconds,
        metavar="S",
        help="seconds past the grace after which the engine logs the workers a step still"
        " holds; 2 s later a server whose engine still runs logs which request holds which"
        " worker and exits with status 1: a hard bound from the first signal, whatever a"
        " step does (default 10)",
    ),
    Option(
        flag="--close-timeout",
        group=LIMITS,
        type=seconds,
        default=5.0,
        metavar="S",
        applies=Applies.NOT_RAY,
        help="seconds the last responses get to reach their clients after the drain;"
        " connections still open then are aborted (default 5)",
    ),
    Option(
        flag="--max-step-time",
        sets="engine_config.max_step_s",
        group=LIMITS,
        type=bound,
        metavar="S|none",
        help="the longest one denoise step of a request alone may take: a request whose"
        " step this server measured (warm, at its size or a smaller one) to take longer is"
        " refused with a 400, since an abort, a deadline or a shutdown lands only at a"
        f" step's end or a cancel point; 'none': no bound (default {_MAX_STEP_S:g})",
    ),
    Option(
        flag="--torch-threads",
        sets="engine_config.torch_threads",
        group=LIMITS,
        type=count(1, 4096),
        metavar="N",
        help="torch's intra-op threads for the process, shared by every worker (default:"
        " torch's own with one worker; the cores shared out among CPU workers)",
    ),
    Option(
        flag="--max-steps",
        sets="engine_config.max_steps",
        group=LIMITS,
        type=count(1),
        default=200,
        help="largest num_inference_steps (default 200)",
    ),
    Option(
        flag="--max-size",
        sets=("engine_config.max_height", "engine_config.max_width"),
        group=LIMITS,
        type=count(1),
        default=2048,
        help="largest width and height (default 2048)",
    ),
    Option(
        flag="--max-n",
        sets="engine_config.max_num_images",
        group=LIMITS,
        type=count(1),
        default=8,
        help="most images per request (default 8)",
    ),
    Option(
        flag="--result-cache",
        sets="result_cache",
        group=LIMITS,
        type=result_cache,
        metavar="BYTES[:DIR]",
        help="keep the outputs of seeded requests and answer their exact repeats from them"
        " (L95): at most BYTES (512M, 2G), in memory, or in files under DIR that survive a"
        " restart (default: off)",
    ),
    Option(
        flag="--result-cache-scope",
        sets="result_cache",
        group=LIMITS,
        choices=("tenant", "global"),
        default="tenant",
        help="whose requests share the result cache's outputs (L96): each tenant its own,"
        " or all (global: a hit's speed tells one tenant what another asked) (default tenant)",
    ),
    Option(
        flag="--max-body-bytes",
        sets="max_body_bytes",
        group=LIMITS,
        type=count(1),
        help="larger request bodies get 413 (default 1 MiB)",
    ),
    Option(
        flag="--max-upload-bytes",
        sets="upload_limits.max_bytes",
        group=LIMITS,
        type=count(1),
        help="larger /v1/images/edits uploads get 413 (default 16 MiB)",
    ),
    Option(
        flag="--max-upload-pixels",
        sets="upload_limits.max_pixels",
        group=LIMITS,
        type=count(1),
        help="an uploaded image of more pixels (read from its header, before decoding)"
        " gets 413 (default 4096x4096)",
    ),
    Option(
        flag="--retry-after",
        sets="retry_after_s",
        group=LIMITS,
        type=count(0),
        metavar="S",
        help="Retry-After seconds sent with 429 and 503 (default 1)",
    ),
    Option(
        flag="--max-priority",
        sets="max_priority",
        group=LIMITS,
        type=count(0, MAX_PRIORITY),
        help="highest priority a request may ask for; more is a 400 (default 0: clients are"
        " anonymous, none may put itself ahead of the others)",
    ),
    Option(
        flag="--video-jobs",
        sets="video_jobs",
        group=VIDEOS,
        type=count(1),
        metavar="N",
        applies=Applies.VIDEO,
        help="most video jobs held at once, finished ones included; then 429 (default 64)",
    ),
    Option(
        flag="--video-ttl",
        sets="video_ttl_s",
        group=VIDEOS,
        type=positive,
        metavar="S",
        applies=Applies.VIDEO,
        help="seconds a finished video job (and its MP4) is kept (default 3600)",
    ),
    Option(
        flag="--video-fps",
        sets="video_fps",
        group=VIDEOS,
        type=positive,
        metavar="FPS",
        applies=Applies.VIDEO,
        help="frames per second of the MP4s, which turns seconds into frames"
        " (default: the model's; Wan 16, LTX-Video 25)",
    ),
    Option(
        flag="--video-bytes",
        sets="video_bytes",
        group=VIDEOS,
        type=count(1),
        metavar="BYTES",
        applies=Applies.VIDEO,
        help="most bytes of MP4s held at once; then 429 (default: no bound but --video-jobs)",
    ),
    Option(
        flag="--jobs-dir",
        sets="jobs_dir",
        group=VIDEOS,
        type=jobs_dir,
        # When the parser is built: the folder follows $XDG_STATE_HOME.
        default_factory=lambda: str(default_jobs_dir()),
        metavar="DIR|none",
        applies=Applies.VIDEO,
        help="folder of the durable job store: jobs and MP4s survive a restart or a crash;"
        " 'none' keeps them in memory (default: $XDG_STATE_HOME/omni-trio/jobs, else"
        " ~/.local/state/omni-trio/jobs)",
    ),
    Option(
        flag="--jobs-db",
        sets="jobs_db",
        group=VIDEOS,
        metavar="postgresql://...",
        applies=Applies.VIDEO,
        help="keep the jobs, MP4s and checkpoints in PostgreSQL instead of --jobs-dir (L98;"
        " the postgres extra): with --jobs-lease, servers that share nothing but the database"
        " share its jobs (default: --jobs-dir)",
    ),
    Option(
        flag="--checkpoint-every",
        sets="checkpoint_every_s",
        group=VIDEOS,
        type=interval,
        metavar="S|never",
        applies=Applies.VIDEO,
        help="seconds between two checkpoints of a running job (with --jobs-dir): a crash"
        " redoes at most this much of its steps; 0: every step (default 30)",
    ),
    Option(
        flag="--jobs-lease",
        sets="jobs_lease_s",
        group=VIDEOS,
        type=positive,
        metavar="S",
        applies=Applies.VIDEO,
        help="share --jobs-dir with the other servers on this host that share it: any of"
        " them serves any job, and one whose server stopped renewing it for S seconds is"
        " taken over from its last checkpoint (default: the folder is this server's"
        f" alone; with --ray, the replicas share it, {DEFAULT_JOBS_LEASE_S:g} s)",
    ),
    Option(
        flag="--decode-tile-above",
        sets="decode_tile_above",
        group=DECODING,
        type=threshold,
        metavar="PIXELS|never",
        applies=Applies.VAE,
        help="decode a frame of more pixels than this in the VAE's blended tiles"
        " (default 1048576: past 1024x1024)",
    ),
    Option(
        flag="--decode-framewise-above",
        sets="decode_framewise_above",
        group=DECODING,
        type=threshold,
        metavar="FRAMES|never",
        applies=Applies.LTX,
        help="decode a LTX-Video clip of more frames than this in the VAE's blended"
        " temporal chunks (default never: the output then equals the pipeline's call)",
    ),
    Option(
        flag="--default-size",
        sets="default_size",
        group=DEFAULTS,
        type=size,
        metavar="WxH",
        help="size when none is asked",
    ),
    Option(
        flag="--default-steps",
        sets="default_steps",
        group=DEFAULTS,
        type=count(1),
        help="num_inference_steps when none is asked",
    ),
    Option(
        flag="--default-guidance",
        sets="default_guidance_scale",
        group=DEFAULTS,
        type=finite,
        help="guidance_scale when none is asked",
    ),
    Option(
        flag="--cache",
        sets="engine_config.default_cache",
        group=DEFAULTS,
        type=step_cache,
        metavar="KIND[:THRESHOLD]",
        help="the step cache of a request that asks for none (L80): first-block[:THRESHOLD]"
        " (default threshold 0.05), taylorseer[:INTERVAL] or none (default: none)",
    ),
    Option(
        flag="--adapter",
        sets="adapters",
        group=ADAPTERS,
        type=adapter,
        action="extend",
        # A list: argparse's extend copies and extends it (the field's () has no extend).
        default=[],
        metavar="NAME=PATH",
        help="load the LoRA file PATH (.safetensors) as NAME at start; repeatable, or"
        " comma-separated",
    ),
    Option(
        flag="--adapter-dir",
        sets="adapter_dir",
        group=ADAPTERS,
        metavar="DIR",
        applies=Applies.ADAPTERS,
        help="the folder POST /v1/adapters loads from (a client names a file in it)",
    ),
    Option(
        flag="--allow-adapter-admin",
        sets="allow_adapter_admin",
        group=ADAPTERS,
        action="store_true",
        applies=Applies.ADAPTERS,
        help="load and unload adapters over HTTP (POST /v1/adapters, DELETE"
        " /v1/adapters/NAME); needs --adapter-dir (default: off)",
    ),
    Option(
        flag="--step-seconds",
        sets="step_seconds",
        type=seconds,
        applies=Applies.FAKE,
        help="simulated compute per step of the fake model (default 0.05)",
    ),
    Option(
        flag="--no-warm-up",
        sets="warm_up",
        dest="warm_up",
        action="store_false",
        applies=Applies.REAL,
        help="answer at once, without the warm-up request (the fewest steps at the default"
        " size) that measures a step first, so that --max-step-time holds for the first"
        " client's request too (default: a real model warms up)",
    ),
    Option(
        flag="--warm-up-sizes",
        sets="warm_up_sizes",
        type=sizes,
        metavar="WxH[,WxH...]",
        applies=Applies.REAL,
        help="the sizes clients ask for, each warmed up before the server answers (a"
        " compiled model's at one and two rows, L90), so that no first request of one is"
        " slow or refused by an estimate from another size (default: the default size)",
    ),
    Option(
        flag="--output-store",
        sets="outputs",
        group=OUTPUTS,
        metavar="DIR|s3://BUCKET[/PREFIX]",
        help="where response_format url outputs are kept: a folder this server serves, or an"
        " S3-compatible bucket (the s3 extra; AWS_* variables: credentials, AWS_ENDPOINT_URL)"
        " (default: none, and url is a 400)",
    ),
    Option(
        flag="--output-ttl",
        sets="outputs",
        group=OUTPUTS,
        type=positive,
        default=3600.0,
        metavar="S",
        help="seconds an output and its URL live (default 3600)",
    ),
    Option(
        flag="--output-secret-file",
        sets="outputs",
        group=OUTPUTS,
        metavar="PATH",
        help="the key URLs are signed with (16 bytes or more), shared by the replicas that"
        " share the store (default: random at start: URLs die with the process)",
    ),
    Option(
        flag="--output-url",
        sets="outputs",
        group=OUTPUTS,
        metavar="URL",
        help="the server's address as clients reach it (a load balancer's), which URLs"
        " start with (default: the request's own)",
    ),
    Option(
        flag="--trace-prompts",
        sets="trace_prompts",
        group=LOGS,
        action="store_true",
        help="with OTEL_TRACES_EXPORTER set (traces, L99; the trace extra): each request's"
        " span holds its prompt too (default: never)",
    ),
    Option(
        # "--api-keys" first: its variable is OMNI_TRIO_API_KEYS, comma-separated.
        flag="--api-keys",
        aliases=("--api-key",),
        sets="keys",
        group=KEYS,
        dest="api_keys",
        action=AppendKeys,
        type=api_keys,
        metavar="KEY",
        help="accept this key as 'Authorization: Bearer KEY' (repeatable, or several"
        " comma-separated): tenants key1, key2, ..., admin keys (default: none, an open"
        " server)",
    ),
    Option(
        flag="--keys-file",
        sets="keys",
        group=KEYS,
        metavar="PATH",
        help="TOML (.toml) or JSON file of keys (or their sha256:<hex>), each with its"
        " tenant, weight, limits and admin flag (see docs/serving.md)",
    ),
    Option(
        flag="--metrics-auth",
        sets="keys",
        group=KEYS,
        action="store_true",
        help="/metrics needs a key too (default: open, for a scraper)",
    ),
    Option(
        flag="--log-level",
        group=LOGS,
        default="info",
        choices=["debug", "info", "warning", "error"],
    ),
    Option(
        flag="--log-format",
        group=LOGS,
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (default text)",
    ),
    Option(
        flag="--no-access-log",
        group=LOGS,
        dest="access_log",
        action="store_false",
        applies=Applies.NOT_RAY,
        help="no line per HTTP request",
    ),
    Option(
        flag="--ray",
        group=RAY,
        action="store_true",
        help="serve through Ray Serve: one engine per replica, behind its HTTP proxy",
    ),
    Option(
        flag="--replicas",
        group=RAY,
        type=count(1),
        default=1,
        metavar="N",
        applies=Applies.RAY,
        help="replicas (default 1)",
    ),
    Option(
        flag="--replica-gpus",
        group=RAY,
        type=gpus,
        default=0.0,
        metavar="G",
        applies=Applies.RAY,
        help="GPUs Ray reserves for each replica (it sees them as cuda:0..); default 0",
    ),
    Option(
        flag="--ray-address",
        group=RAY,
        metavar="ADDR",
        applies=Applies.RAY,
        help="join this Ray cluster (e.g. 10.0.0.1:6379) instead of starting a local one",
    ),
)
"""Every option of ``serve``, in ``--help``'s order."""
