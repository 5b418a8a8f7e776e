"""The model ``serve`` names: the serve package's errors name no option, the command's
name ``--model``; the options that become ``ServiceOptions`` (keys, ``--adapter``).

Pure calls in this process: a missing folder, and a folder whose ``model_index.json``
is not JSON (diffusers fails to load it, with no download); the tiny SD pipeline and a
tiny random LoRA for the adapters loaded at start.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from omni_trio import EngineConfig
from omni_trio.cli._env import resolve_environment
from omni_trio.cli._errors import EXIT_ERROR, EXIT_USAGE, CommandError, UsageError, summary
from omni_trio.cli._main import main
from omni_trio.cli._options import check_model, load, make_service, service_options
from omni_trio.cli._serve import add_serve_arguments
from omni_trio.runners import tiny_lora
from omni_trio.serve._models import MODELS, ModelError, load_model
from omni_trio.serve._options import ServiceOptions
from omni_trio.serve.jobs import default_jobs_dir
from tests.support.runners import tiny

BUILT_IN = f"the built-in models are {', '.join(MODELS)}, or give a hub id (org/name)"


def broken_folder(tmp_path: Path) -> Path:
    """A diffusers folder in name only: its ``model_index.json`` is not JSON."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model_index.json").write_text("{not json")
    return folder


def test_the_serve_package_names_no_option(tmp_path: Path) -> None:
    """``load_model``: a ``ValueError`` for a spec that names no model, a ``ModelError``
    (the loader's error its cause) for one that does not load; neither says ``--model``,
    so a Ray replica that raises one says what failed, not which option."""
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"^no such folder: ") as unknown:
        load_model(missing, step_seconds=0.0)
    assert str(unknown.value) == f"no such folder: {missing!r}; {BUILT_IN}"
    folder = broken_folder(tmp_path)
    with pytest.raises(ModelError) as failed:
        load_model(str(folder), step_seconds=0.0)
    assert str(failed.value) == f"cannot load {str(folder)!r}"
    assert isinstance(failed.value.__cause__, Exception)


def test_the_command_names_the_option(tmp_path: Path) -> None:
    """The same errors from the command: a usage error and an error, each one line that
    starts with ``--model``, the cause's type and first line after the model's."""
    missing = str(tmp_path / "nope")
    with pytest.raises(UsageError) as unknown:
        check_model(missing)
    assert str(unknown.value) == f"--model: no such folder: {missing!r}; {BUILT_IN}"
    assert unknown.value.exit_status == EXIT_USAGE
    check_model("fake")  # a built-in name: nothing to check on disk
    folder = broken_folder(tmp_path)
    with pytest.raises(CommandError) as failed:
        load(ServiceOptions(model=str(folder), step_seconds=0.0))
    model_error = failed.value.__cause__
    assert isinstance(model_error, ModelError) and model_error.__cause__ is not None
    assert str(failed.value) == f"--model: cannot load {str(folder)!r}: " + summary(
        model_error.__cause__
    )
    assert failed.value.exit_status == EXIT_ERROR
    assert "\n" not in str(failed.value)


def parse(*argv: str) -> argparse.Namespace:
    """``serve``'s arguments, parsed as the command parses them."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_options_become_service_options() -> None:
    """``serve``'s defaults are the command's own (a queue of 256, 10 s of grace, at most
    200 steps, video jobs in the user's state folder); what it leaves to the model stays
    ``None``; devices are a tuple."""
    assert service_options(parse("--model", "fake")) == ServiceOptions(
        model="fake",
        step_seconds=0.05,
        jobs_dir=str(default_jobs_dir()),
        engine_config=EngineConfig(
            max_batch_size=4,
            max_waiting=256,
            shutdown_grace=10.0,
            max_steps=200,
            max_height=2048,
            max_width=2048,
            max_num_images=8,
        ),
    )
    options = service_options(parse("--model", "fake", "--workers", "2", "--default-size", "32x48"))
    assert (options.devices, options.default_size) == (("cpu", "cpu"), (32, 48))
    assert options.engine_config.torch_threads is None
    threads = service_options(parse("--model", "fake", "--torch-threads", "3"))
    assert threads.engine_config.torch_threads == 3
    with pytest.raises(UsageError, match=r"^--devices: "):
        service_options(parse("--model", "fake", "--devices", "cpu,,"))


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--default-size", "60x64"], "--default-size: the model refuses it: width: must be"),
        (["--default-steps", "500"], "--default-steps: the model refuses it: num_steps: must"),
    ],
)
def test_a_default_the_model_refuses_names_its_option(argv: list[str], line: str) -> None:
    """``make_service``: the field ``build_service`` names becomes the option that set it."""
    options = service_options(parse("--model", "fake", *argv))
    with pytest.raises(UsageError) as refused:
        make_service(options, load(options))
    assert str(refused.value).startswith(line)


def test_api_keys_from_the_command_line_the_environment_and_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L55: ``--api-key`` (repeatable, or comma-separated), ``OMNI_TRIO_API_KEYS`` and
    ``--keys-file`` give ``ServiceOptions.keys``; none: an open server (``None``)."""
    assert service_options(parse("--model", "fake")).keys is None
    options = service_options(
        parse("--model", "fake", "--api-key", "k-1", "--api-key", "k-2,k-3", "--metrics-auth")
    )
    assert options.keys is not None and options.keys.metrics_auth
    assert options.keys.tenants == ("key1", "key2", "key3")
    assert options.keys.find("k-3") is not None
    monkeypatch.setenv("OMNI_TRIO_API_KEYS", "e-1,e-2")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", "fake"])
    resolve_environment(args)
    from_env = service_options(args).keys
    assert from_env is not None and from_env.find("e-2") is not None
    keys_file = tmp_path / "keys.json"
    keys_file.write_text('{"keys": [{"key": "f-1", "tenant": "acme", "weight": 2}]}')
    both = service_options(
        parse("--model", "fake", "--api-key", "k-1", "--keys-file", str(keys_file))
    )
    assert both.keys is not None and both.keys.tenants == ("key1", "acme")


def test_wrong_keys_are_usage_errors_that_never_show_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """L55: a bad key, a bad keys file or ``--metrics-auth`` alone are refused by their
    option, and no message quotes a key."""
    with pytest.raises(SystemExit):
        parse("--model", "fake", "--api-key", "sk-hidden one")
    assert "sk-hidden" not in capsys.readouterr().err
    # Not ASCII: no client would send it alike (L55), so it is refused, not kept unmatched.
    with pytest.raises(SystemExit):
        parse("--model", "fake", "--api-key", "sk-hiddén")
    err = capsys.readouterr().err
    assert "printable ASCII" in err.splitlines()[-1] and "sk-hidd" not in err
    bad = tmp_path / "keys.toml"
    bad.write_text("[[keys]]\nkey = 'sk-hidden-two'\ntenant = 'a'\nweight = -1\n")
    with pytest.raises(UsageError, match=r"^--keys-file: .*entry 1: weight") as refused:
        service_options(parse("--model", "fake", "--keys-file", str(bad)))
    assert "sk-hidden" not in str(refused.value)
    with pytest.raises(UsageError, match=r"^--metrics-auth: needs an API key"):
        service_options(parse("--model", "fake", "--metrics-auth"))


def test_adapters_at_start_are_repeatable_and_comma_separated() -> None:
    """L88: ``--adapter NAME=PATH``, repeated or comma-separated, gives
    ``ServiceOptions.adapters`` in the order given; none: no adapters."""
    assert service_options(parse("--model", "fake")).adapters == ()
    argv = ["--adapter", "ink=a/ink.safetensors,film=film.safetensors"]
    argv += ["--adapter", "dust=/b/dust.safetensors"]
    assert service_options(parse("--model", "fake", *argv)).adapters == (
        ("ink", "a/ink.safetensors"),
        ("film", "film.safetensors"),
        ("dust", "/b/dust.safetensors"),
    )


@pytest.mark.parametrize("value", ["ink.safetensors", "ink=a.safetensors,film"])
def test_an_adapter_without_a_name_is_one_line_and_status_2(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """L88: ``serve --adapter`` without ``NAME=`` stops at parsing: one line, status 2,
    naming the option and the item at fault."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "fake", "--adapter", value])
    assert exited.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("omni-trio: error: argument --adapter: expected NAME=PATH"), err
    item = value.rpartition(",")[2]
    assert f"got {item!r}" in err and err.count("\n") == 1


def test_an_adapter_file_that_is_missing_names_the_option(tmp_path: Path) -> None:
    """L88: the adapters load when the service is made: a missing file, or a model that
    takes none, is a usage error naming ``--adapter``; a file that is there loads."""
    made = tiny_lora(tiny("sd"), tmp_path, "ink", seed=1)
    missing = tmp_path / "film.safetensors"
    options = service_options(parse("--model", "tiny-sd", "--adapter", f"ink={made}"))
    model = load(options)
    try:
        make_service(options, model)
        assert [info.name for info in model.runners[0].adapters()] == ["ink"]
    finally:
        model.runners[0].close()
    options = service_options(
        parse("--model", "tiny-sd", "--adapter", f"ink={made}", "--adapter", f"film={missing}")
    )
    model = load(options)
    try:
        with pytest.raises(UsageError) as refused:
            make_service(options, model)
    finally:
        model.runners[0].close()
    assert str(refused.value) == f"--adapter: adapter 'film': no file {missing.resolve()}"
    assert refused.value.exit_status == EXIT_USAGE
    options = service_options(parse("--model", "fake", "--adapter", f"ink={made}"))
    with pytest.raises(UsageError) as refused:
        make_service(options, load(options))
    assert str(refused.value) == "--adapter: ink: this model takes no adapters"


def test_max_step_time_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """L4: ``--max-step-time`` (``OMNI_TRIO_MAX_STEP_TIME``) is ``EngineConfig.max_step_s``,
    the longest one step of a request alone may take: seconds, or ``none`` for no bound;
    left out, the engine's own 30 s."""
    assert service_options(parse("--model", "fake")).engine_config.max_step_s == 30.0
    given = service_options(parse("--model", "fake", "--max-step-time", "2.5"))
    assert given.engine_config.max_step_s == 2.5
    unbounded = service_options(parse("--model", "fake", "--max-step-time", " None "))
    assert unbounded.engine_config.max_step_s is None
    monkeypatch.setenv("OMNI_TRIO_MAX_STEP_TIME", "none")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", "fake"])
    assert resolve_environment(args) == {"max_step_time"}
    assert service_options(args).engine_config.max_step_s is None
    # The command line wins over the variable.
    args = parser.parse_args(["--model", "fake", "--max-step-time", "7"])
    resolve_environment(args)
    assert service_options(args).engine_config.max_step_s == 7.0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon", ""])
def test_a_bad_max_step_time_is_one_line_and_status_2(
    value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """L4: ``serve --max-step-time`` takes seconds > 0 or ``none``; anything else stops at
    parsing, one line naming the option (or its variable) and the value, status 2."""
    expected = f"expected a number of seconds > 0 or 'none', got {value!r}"
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "fake", "--max-step-time", value])
    assert exited.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == (
        f"omni-trio: error: argument --max-step-time: {expected} (see 'omni-trio serve --help')\n"
    )
    monkeypatch.setenv("OMNI_TRIO_MAX_STEP_TIME", value)
    assert main(["serve", "--model", "fake"]) == EXIT_USAGE
    assert capsys.readouterr().err == f"omni-trio: error: OMNI_TRIO_MAX_STEP_TIME: {expected}\n"


def test_caches_outputs_traces_and_warm_up_sizes_reach_the_service(tmp_path: Path) -> None:
    """L95, L96, L97, L99, L4: ``--result-cache`` and its scope, the output store's four
    options, ``--trace-prompts`` and ``--warm-up-sizes`` become the service's settings."""
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-more-than-16-bytes\n")
    argv = [
        "--model", "fake",
        "--result-cache", "2M:" + str(tmp_path / "results"),
        "--result-cache-scope", "global",
        "--output-store", str(tmp_path / "outputs"),
        "--output-ttl", "60",
        "--output-secret-file", str(secret),
        "--output-url", "https://img.example",
        "--trace-prompts",
        "--warm-up-sizes", "64x64,32x48",
    ]  # fmt: skip
    options = service_options(parse(*argv))
    service = make_service(options, load(options))
    cache = service.engine_config.result_cache
    assert cache is not None
    assert (cache.max_bytes, cache.folder, cache.scope) == (
        2 << 20,
        str(tmp_path / "results"),
        "global",
    )
    outputs = service.config.outputs
    assert outputs is not None
    assert (outputs.store, outputs.ttl_s, outputs.public_url) == (
        str(tmp_path / "outputs"),
        60.0,
        "https://img.example",
    )
    assert outputs.secret == b"a-secret-of-more-than-16-bytes"
    assert service.config.warm_up_sizes == ((64, 64), (32, 48))
    assert options.trace_prompts and service.tracing.provider is None  # no OTEL_* variable
    plain = make_service(service_options(parse("--model", "fake")), load(options))
    assert plain.engine_config.result_cache is None and plain.config.outputs is None


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--output-url", "https://x.example"], "--output-url: needs --output-store"),
        (["--output-secret-file", "s"], "--output-secret-file: needs --output-store"),
        (["--output-store", "o", "--output-url", "ftp://x"], "--output-url: must start with"),
        (["--output-store", "o", "--output-secret-file", "missing"], "--output-secret-file: "),
        (["--output-store", "o", "--output-secret-file", "short"], "--output-secret-file: must"),
    ],
)
def test_a_wrong_output_store_setting_names_its_option(
    argv: list[str], line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L97: each refusal of the output store's options is one line naming the option."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short").write_text("too short")
    with pytest.raises(UsageError) as refused:
        service_options(parse("--model", "fake", *argv))
    assert str(refused.value).startswith(line)


def test_jobs_db_keeps_the_jobs_in_postgresql_instead_of_the_folder() -> None:
    """L98: ``--jobs-db`` makes the video jobs' store PostgreSQL's (opened when the server
    starts, not here); the folder is then unused, and ``--jobs-lease`` shares it."""
    dsn = "postgresql://jobs@127.0.0.1:1/jobs"
    options = service_options(parse("--model", "fake", "--jobs-db", dsn, "--jobs-lease", "5"))
    assert options.jobs_db == dsn
    service = make_service(options, load(options))
    videos = service.videos.config
    assert videos.jobs_dir is None and videos.store is not None and videos.lease_s == 5.0
    alone = service_options(parse("--model", "fake", "--jobs-db", dsn))
    assert make_service(alone, load(alone)).videos.config.lease_s is None


def test_a_spec_setting_the_model_refuses_names_its_option() -> None:
    """L89: ``load``: a setting the model spec refuses is a usage error naming the option
    that set it, as the demo's (not the spec's field)."""
    options = service_options(parse("--model", "tiny-flux", "--compile-cache", "cache"))
    with pytest.raises(UsageError) as refused:
        load(options)
    assert str(refused.value).startswith("--compile-cache: only with compile"), refused.value
