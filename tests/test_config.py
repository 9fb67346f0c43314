"""The one typed config: defaults < file < environment < flags, key by key; every bad value fails at
start with a message naming the key and where the value came from; `baton config show`."""
import json
from pathlib import Path

import pytest

from baton import cli
from baton.shared import config
from baton.shared.config import ConfigError

pytestmark = pytest.mark.unit


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "baton.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_services_own_defaults():
    from baton.services.router.flow import RouterTimeouts
    from baton.services.worker import WorkerConfig
    cfg = config.load(env={})
    built = WorkerConfig.of("decode", cfg)
    assert built == WorkerConfig(role="decode", worker=config.WorkerSection(id=built.worker.id))
    assert RouterTimeouts.of(cfg.router) == RouterTimeouts()  # the flow's defaults are the section's
    assert cfg.model_name == "baton-tiny" and cfg.nats.url == "" and cfg.sources == {}


def test_each_layer_overrides_the_one_below_key_by_key(tmp_path):
    path = write(tmp_path, "[worker]\ndraft_tokens = 4\nnum_slots = 8\nkv_mode = 'paged'\n[http]\nport = 9000\n")
    env = {"BATON_WORKER_DRAFT_TOKENS": "5", "BATON_WORKER_NUM_SLOTS": "9", "BATON_CONFIG": "/nonexistent"}
    cfg = config.load(path, env=env, flags={"worker.draft_tokens": 6})
    assert cfg.worker.draft_tokens == 6 and cfg.source("worker.draft_tokens") == "flag --draft-tokens"
    assert cfg.worker.num_slots == 9 and cfg.source("worker.num_slots") == "env BATON_WORKER_NUM_SLOTS"
    assert cfg.worker.kv_mode == "paged" and cfg.source("worker.kv_mode") == f"file {path}"
    assert cfg.http.port == 9000 and cfg.worker.spec == "mtp" and cfg.source("worker.spec") == "default"


def test_file_comes_from_baton_config_when_not_given(tmp_path):
    path = write(tmp_path, "[up]\nprefill = 2\nhttp = true\n")
    cfg = config.load(env={"BATON_CONFIG": str(path)})
    assert cfg.up.prefill == 2 and cfg.up.http is True


def test_cli_flags_override_env_and_file_and_absent_flags_do_not(tmp_path, monkeypatch):
    path = write(tmp_path, "[worker]\nspec = 'off'\nthreads = 2\n[log]\ndir = 'from-file'\n")
    monkeypatch.setenv("BATON_WORKER_THREADS", "3")
    args = cli.parser().parse_args(["up", "--config", str(path), "--threads", "1", "--prefill", "2", "--http"])
    cfg = cli.effective_config(args)
    cli.apply_config(cfg, args)
    assert (args.threads, args.spec, args.prefill, args.decode, args.log_dir) == (1, "off", 2, 1, "from-file")
    assert args.http is True and args.http_port == 8000 and args.nats_url is None and args.nats_port is None
    assert args.model == Path(config.DEFAULT_MODEL_DIR)
    assert cli.worker_argv(args)[:2] == ["--spec", "off"]


def test_device_and_dtype_go_from_flags_env_and_file_to_every_worker_baton_up_starts(tmp_path, monkeypatch):
    path = write(tmp_path, "[worker]\ndevice = 'cuda:1'\n")
    monkeypatch.setenv("BATON_WORKER_DTYPE", "bfloat16")
    args = cli.parser().parse_args(["up", "--config", str(path)])
    cli.apply_config(cli.effective_config(args), args)
    argv = cli.worker_argv(args)
    assert argv[argv.index("--device") + 1] == "cuda:1" and argv[argv.index("--dtype") + 1] == "bfloat16"
    served = cli.parser().parse_args(["serve", "decode", "--config", str(path), *argv, "--device", "cuda"])
    from baton.services.worker import WorkerConfig
    w = WorkerConfig.of("decode", cli.effective_config(served)).worker
    assert (w.device, w.dtype) == ("cuda", "bfloat16")
    aggregated = WorkerConfig.of("aggregated", cli.effective_config(served)).worker
    assert (aggregated.device, aggregated.dtype) == ("cuda", "bfloat16")


def test_serve_builds_the_worker_config_from_all_layers(tmp_path, monkeypatch):
    path = write(tmp_path, "[worker]\nprefill_chunk = 128\ntransfer_deadline_s = 7\ntransfer_threads = 3\n"
                           "[router]\nmax_in_flight = 3\n")
    monkeypatch.setenv("BATON_WORKER_KV_MODE", "paged")
    args = cli.parser().parse_args(["serve", "prefill", "--config", str(path), "--draft-state", "cold", "--spec", "off"])
    cfg = cli.effective_config(args)
    from baton.services.worker import WorkerConfig
    w = WorkerConfig.of("prefill", cfg).worker
    assert (w.kv_mode, w.draft_state, w.spec, w.prefill_chunk, w.transfer_deadline_s, w.transfer_threads) == (
        "paged", "cold", "off", 128, 7.0, 3)
    assert w.id.startswith("prefill-")
    assert cfg.router.max_in_flight == 3


@pytest.mark.parametrize("env, message", [
    ({"BATON_WORKER_DRAFT_TOKENS": "0"}, "worker.draft_tokens: must be in 1..16, got 0 (from env BATON_WORKER_DRAFT_TOKENS)"),
    ({"BATON_HTTP_PORT": "eighty"}, "http.port: expected int, got 'eighty' (from env BATON_HTTP_PORT)"),
    ({"BATON_UP_HTTP": "maybe"}, "up.http: expected bool, got 'maybe' (from env BATON_UP_HTTP)"),
    ({"BATON_WORKER_KV_MODE": "flat"}, "worker.kv_mode: must be one of ring, paged; got 'flat'"),
    ({"BATON_WORKER_DEVICE": "gpu0"}, "worker.device: must be cpu, cuda or cuda:N; got 'gpu0'"),
    ({"BATON_WORKER_DEVICE": "cuda:x"}, "worker.device: must be cpu, cuda or cuda:N; got 'cuda:x'"),
    ({"BATON_WORKER_DTYPE": "float16"}, "worker.dtype: must be one of float32, bfloat16; got 'float16'"),
    ({"BATON_ROUTER_REQUEST_TIMEOUT_S": "-1"}, "router.request_timeout_s: must be > 0, got -1.0"),
    ({"BATON_WORKER_DRAFT_TOKEN": "3"}, "BATON_WORKER_DRAFT_TOKEN: no config key worker.draft_token"),
    ({"BATON_MODEL_PATH": "/no/such/model"}, "model.path: no such directory: /no/such/model"),
    ({"BATON_NATS_PASSWORD": "secret"}, "nats.user: must be set when nats.password is"),
    ({"BATON_NATS_TLS_CERT_FILE": "c.pem"}, "nats.tls_key_file: must be set together with nats.tls_cert_file"),
])
def test_bad_environment_values_name_the_key(env, message):
    with pytest.raises(ConfigError) as exc:
        config.load(env=env)
    assert message in str(exc.value)


@pytest.mark.parametrize("text, message", [
    ("[worker]\ndraft_tokens = 17\n", "worker.draft_tokens: must be in 1..16, got 17 (from file "),
    ("[worker]\ndraft_tokens = '3'\n", "worker.draft_tokens: expected int, got str '3'"),
    ("[worker]\nthreads = true\n", "worker.threads: expected int, got bool True"),
    ("[worker]\nnum_pagez = 1\n", "worker.num_pagez: unknown key in"),
    ("[workers]\nnum_pages = 1\n", "workers: unknown section in"),
    ("worker = 3\n", "worker: must be a table"),
    ("[worker\n", "not valid TOML"),
])
def test_bad_file_values_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as exc:
        config.load(write(tmp_path, text), env={})
    assert message in str(exc.value)


def test_missing_file_and_unrelated_variables(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "nope.toml", env={})
    # variables that are not configuration (other prefixes) are left alone
    assert config.load(env={"BATON_STATE": "x", "BATON_TRANSFER_FAULTS": "y", "BATON_TEST_MODEL": "z"}) == config.load(env={})


def test_values_are_parsed_from_strings():
    cfg = config.load(env={"BATON_UP_HTTP": "yes", "BATON_ROUTER_IDLE_TIMEOUT_S": "2.5", "BATON_LOG_LEVEL": "debug",
                           "BATON_NATS_URL": "nats://a:4222, nats://b:4222"})
    assert cfg.up.http is True and cfg.router.idle_timeout_s == 2.5 and cfg.log.level == "debug"
    assert cfg.nats_servers() == ["nats://a:4222", "nats://b:4222"]
    assert config.load(env={"BATON_ROUTER_IDLE_TIMEOUT_S": "3"}).router.idle_timeout_s == 3.0


def test_nats_options_carry_credentials():
    cfg = config.load(env={"BATON_NATS_USER": "client", "BATON_NATS_PASSWORD": "pw"})
    assert cfg.nats_options() == {"user": "client", "password": "pw", "connect_timeout_s": 5.0}


def test_config_show_prints_effective_values_and_sources(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "[worker]\nnum_pages = 100\n[nats]\nuser = 'service'\npassword = 'hunter2'\n")
    monkeypatch.setenv("BATON_HTTP_PORT", "8123")
    assert cli.main(["config", "show", "--config", str(path), "--draft-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and 'password = "***"' in out
    assert f"num_pages = 100  # KV pages per worker [file {path};" in out
    assert "port = 8123" in out and "[env BATON_HTTP_PORT;" in out
    assert "draft_tokens = 5" in out and "[flag --draft-tokens;" in out
    # the TOML it prints is itself a valid config file with the same values
    shown = tmp_path / "shown.toml"
    shown.write_text(out.replace('"***"', '"hunter2"'))
    assert config.as_dict(config.load(shown, env={}), reveal=True) == \
        config.as_dict(config.load(path, env={"BATON_HTTP_PORT": "8123"}, flags={"--draft-tokens": 5}), reveal=True)

    assert cli.main(["config", "show", "--config", str(path), "--json", "--reveal"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["nats"]["password"] == "hunter2" and shown["http"]["port"] == 8123


def test_invalid_config_stops_every_command_with_the_key(monkeypatch, capsys):
    monkeypatch.setenv("BATON_WORKER_NUM_SLOTS", "0")
    for argv in (["config", "show"], ["serve", "decode"], ["up"]):
        assert cli.main(argv) == 2
        assert "worker.num_slots: must be >= 1, got 0 (from env BATON_WORKER_NUM_SLOTS)" in capsys.readouterr().err
    monkeypatch.delenv("BATON_WORKER_NUM_SLOTS")
    assert cli.main(["serve", "decode", "--page-size", "0"]) == 2
    assert "worker.page_size: must be in 1..4096, got 0 (from flag --page-size)" in capsys.readouterr().err


def test_every_key_has_help_and_an_env_name():
    for dotted, f in config.keys().items():
        assert f.metadata["help"], dotted
        section, name = dotted.split(".", 1)
        assert config.env_name(dotted) == f"BATON_{section.upper()}_{name.upper()}"
    for flag, dotted in config.FLAGS.items():  # every flag a config key claims exists on some command
        assert any(flag in sub.format_help() for sub in _subparsers()), flag


def _subparsers():
    import argparse
    ap = cli.parser()
    actions = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return list(actions[0].choices.values())


@pytest.mark.parametrize("argv, want", [([], None), (["--draft-tokens", "0"], 0), (["--draft-tokens", "2"], 2)])
def test_generate_draft_tokens_sets_the_request_not_the_worker_key(monkeypatch, argv, want):
    """`baton generate --draft-tokens` is GenerateRequest.draft_tokens, not the worker's
    `--draft-tokens` (whose 1..16 check would refuse 0 and whose default 3 would fill in None)."""
    from baton import client
    sent = []

    async def fake_generate(args, url):
        sent.append(client.build_request(args))
        return 0
    monkeypatch.setattr(client, "generate", fake_generate)
    monkeypatch.setenv("BATON_NATS_URL", "nats://127.0.0.1:1")
    assert cli.main(["generate", "hi", *argv]) == 0
    assert sent[0].draft_tokens == want and sent[0].prompt == "hi"
