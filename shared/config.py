"""One typed configuration for every Baton process.

Layers, later ones win key by key:

    defaults  <  TOML file (--config FILE or BATON_CONFIG)  <  environment (BATON_<SECTION>_<KEY>)  <  CLI flags

Every key lives in a section (`[worker] draft_tokens = 3`, `BATON_WORKER_DRAFT_TOKENS=3`,
`--draft-tokens 3`). Values are parsed to the key's type and checked once, at start-up; a bad
value stops the process with a message that names the key and where the value came from:

    worker.draft_tokens: must be in 1..16, got 0 (from env BATON_WORKER_DRAFT_TOKENS)

Unknown keys in the file, or `BATON_<SECTION>_...` variables of a known section that name no
key, are errors too (a typo must not be silently ignored). Variables of other prefixes
(`BATON_STATE`, `BATON_TRANSFER_FAULTS`, ...) are not configuration and are left alone.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from baton.proto.public import MAX_DRAFT_TOKENS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "BATON_"
CONFIG_ENV = "BATON_CONFIG"
Check = Callable[[Any], "str | None"]
# the shipped checkpoint (baton.shared.model.checkpoint re-exports it; here it needs no torch)
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "baton-tiny"


class ConfigError(ValueError):
    """An invalid configuration; the message names the key (`section.key`) and its source."""


# --- checks: each returns None when the value is fine, else what is wrong ---------------------
def between(lo: float, hi: float | None = None) -> Check:
    def check(v):
        if v < lo or (hi is not None and v > hi):
            return f"must be in {lo}..{hi}, got {v}" if hi is not None else f"must be >= {lo}, got {v}"
        return None
    return check


def one_of(*options: str) -> Check:
    def check(v):
        return None if v in options else f"must be one of {', '.join(options)}; got {v!r}"
    check.options = options  # the CLI offers them as the flag's choices
    return check


def positive(v) -> str | None:
    return None if v > 0 else f"must be > 0, got {v}"


def device_name(v: str) -> str | None:
    """`cpu`, `cuda` or `cuda:N` (whether that device exists is checked where the model loads)."""
    kind, _, index = v.partition(":")
    if v == "cpu" or (kind == "cuda" and (not _ or index.isdigit())):
        return None
    return f"must be cpu, cuda or cuda:N; got {v!r}"


def cpu_ids(v: str) -> set[int]:
    """A CPU list as Linux writes one (`3`, `0-1`, `0,2-3`) -> its ids; "" -> none."""
    ids: set[int] = set()
    for part in filter(None, v.replace(" ", "").split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"not a CPU list: {v!r} (e.g. 3, 0-1, 0,2-3)")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return ids


def cpu_list(v: str) -> str | None:
    try:
        cpu_ids(v)
    except ValueError as exc:
        return str(exc)
    return None


def key(default: Any, help: str, check: Check | None = None, secret: bool = False, flag: str = "") -> Any:
    """A config key: its default, one line of help, an optional check, and the CLI flag (if any)."""
    return field(default=default, metadata={"help": help, "check": check, "secret": secret, "flag": flag})


# --- sections --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NatsSection:
    url: str = key("", "NATS server URL(s), comma-separated; empty: the running `baton up`, else "
                   "nats://127.0.0.1:4222", flag="--nats-url")
    user: str = key("", "user name (see compose/nats/nats.conf for the accounts)")
    password: str = key("", "password for `user`", secret=True)
    token: str = key("", "auth token", secret=True)
    creds_file: str = key("", "NATS credentials file (JWT + nkey)")
    tls_ca_file: str = key("", "CA bundle to verify the server")
    tls_cert_file: str = key("", "client certificate (mutual TLS)")
    tls_key_file: str = key("", "client key (mutual TLS)")
    connect_timeout_s: float = key(5.0, "give up connecting at start after this long", positive)


@dataclass(frozen=True)
class ModelSection:
    path: str = key(str(DEFAULT_MODEL_DIR), "Hugging Face-style model directory", flag="--model")
    name: str = key("", "model name served over HTTP (/v1/models); empty: the directory's name")


@dataclass(frozen=True)
class RouterSection:
    max_in_flight: int = key(1024, "requests one router drives at once; beyond it answers busy", between(1))
    max_queued: int = key(512, "requests that wait in one router's queue for capacity (FIFO); beyond it answers "
                               "busy (HTTP 429)", between(0))
    max_queue_s: float = key(120.0, "longest a request waits in the queue; then it fails with timeout", positive)
    max_tokens: int = key(4096, "largest max_tokens a request may ask for", between(1))
    request_timeout_s: float = key(600.0, "whole request, admission to last token", positive)
    first_token_timeout_s: float = key(120.0, "admission to first token (prefill + transfer)", positive)
    idle_timeout_s: float = key(60.0, "silence between two chunks of a stream", positive)
    control_timeout_s: float = key(5.0, "one control round trip (reserve, release)", positive)
    prefix_affinity: float = key(1.0, "weight of a prefill worker's cached prompt prefix against its queued tokens "
                                      "when picking one (cost: queued + prompt - weight * overlap); 0: load only",
                                 between(0))
    prefill_on_decode_tokens: int = key(256, "a prompt of at most this many tokens that no worker holds a prefix of "
                                             "is prefilled by its decode worker itself when nothing else runs there "
                                             "(conditional disaggregation: no hand-off, and no stream waits behind "
                                             "it); 0: every prompt on a prefill worker", between(0))


@dataclass(frozen=True)
class RegistrySection:
    replicas: int = key(1, "replicas of the workers' JetStream KV bucket (3 in a 3-node NATS cluster, so the "
                           "registry's state survives a node); an existing bucket is changed to this", between(1, 5))
    check_metadata: bool = key(True, "load each registering worker's NIXL metadata as a peer would and refuse "
                               "it if it does not load, names another agent or lacks the manifest's memory; "
                               "needs the workers' UCX addresses reachable from the registry")


@dataclass(frozen=True)
class WorkerSection:
    id: str = key("", "worker id; empty: role + random suffix (a restart is a new NIXL peer)", flag="--worker-id")
    spec: str = key("mtp", "speculative decoding with the MTP draft", one_of("mtp", "off"), flag="--spec")
    draft_tokens: int = key(5, "draft tokens per verify step (k)", between(1, MAX_DRAFT_TOKENS), flag="--draft-tokens")
    draft_state: str = key("transfer", "how decode's draft window starts",
                           one_of("transfer", "rebuild", "cold"), flag="--draft-state")
    kv_mode: str = key("ring", "sliding-window KV storage", one_of("ring", "paged"), flag="--kv-mode")
    num_pages: int = key(2048, "KV pages per worker", between(1), flag="--num-pages")
    page_size: int = key(16, "token positions per page", between(1, 4096), flag="--page-size")
    num_slots: int = key(64, "requests resident at once per worker", between(1), flag="--num-slots")
    max_batch: int = key(64, "prompts per prefill batch / sequences per decode step", between(1), flag="--max-batch")
    prefill_chunk: int = key(256, "prompt tokens per prefill forward", between(1))
    prefill_batch_tokens: int = key(512, "prefill: prompt tokens one batch takes (a longer prompt runs alone), so "
                                         "a burst of prompts reaches decode in parts while the rest compute; "
                                         "0: every queued prompt in one batch", between(0),
                                    flag="--prefill-batch-tokens")
    prefix_cache: int = key(64, "prefill: ends of computed prompts kept, so a prompt that extends one (the next "
                               "turn) computes only its new tokens; 0: off", between(0), flag="--prefix-cache")
    turn_cache: int = key(64, "decode: finished requests' prompts whose full-attention KV is kept, so the next "
                             "turn of a conversation gets it from decode's memory and prefill sends only the "
                             "rest; 0: off", between(0), flag="--turn-cache")
    transfer_deadline_s: float = key(30.0, "a KV transfer not complete by then is aborted", positive)
    transfer_threads: int = key(0, "prefill: threads copying one KV WRITE in parallel chunks (NIXL's UCX thread "
                                   "pool); 0: the agent's own thread copies. Pays off only with spare cores",
                                between(0, 64), flag="--transfer-threads")
    threads: int = key(0, "torch threads per worker (0: torch's default for `baton serve`; `baton up` "
                          "divides the machine's cores among its prefill and decode processes)",
                       between(0), flag="--threads")
    cpus: str = key("", "CPUs this worker's process runs on, as Linux lists them (3, 0-1, 0,2-3); empty: "
                        "wherever the OS puts it (`baton up` gives each engine its own cores, see up.engine_cpus)",
                    cpu_list, flag="--cpus")
    cpu_wake_latency_us: int = key(-1, "while a worker runs, no CPU may take longer than this to wake from idle "
                                       "(Linux PM QoS, /dev/cpu_dma_latency; root only, else a warning): 0 keeps "
                                       "idle CPUs polling, so an engine that waited for work does not start on a "
                                       "cold core (a VM's halted vCPU); -1: the machine decides", between(-1),
                                   flag="--cpu-wake-latency-us")
    device: str = key("cpu", "where a worker's model and KV store live: cpu, cuda or cuda:N", device_name,
                      flag="--device")
    dtype: str = key("float32", "model weights and KV cache: float32 (greedy output equals `transformers` "
                                "fp32) or bfloat16", one_of("float32", "bfloat16"), flag="--dtype")
    projection: str = key("auto", "CPU projection kernel: onednn (prepacked GEMM), blas (mm over the transposed "
                                  "weight) or auto (whichever runs this model faster here, timed at load)",
                          one_of("auto", "onednn", "blas"), flag="--projection")


@dataclass(frozen=True)
class HttpSection:
    host: str = key("127.0.0.1", "address the OpenAI-compatible frontend binds (0.0.0.0: all)", flag="--http-host")
    port: int = key(8000, "its port", between(1, 65535), flag="--http-port")
    request_timeout_s: float = key(600.0, "longest wait for the router's reply (or between stream chunks)", positive)
    default_max_tokens: int = key(256, "max_tokens for a chat request that gives none (completions: 16, as OpenAI)",
                                  between(1))
    max_body_bytes: int = key(8 << 20, "largest request body; larger gets 413", between(1024))
    api_key: str = key("", "a client must send `Authorization: Bearer <key>` (all routes but /health); empty: "
                           "no key needed unless api_key_file gives some", secret=True, flag="--api-key")
    api_key_file: str = key("", "file of further accepted keys, one per line (blank and # lines skipped)",
                            flag="--api-key-file")


@dataclass(frozen=True)
class UpSection:
    prefill: int = key(1, "prefill workers `baton up` starts", between(1), flag="--prefill")
    decode: int = key(1, "decode workers `baton up` starts", between(1), flag="--decode")
    nats_port: int = key(0, "port of the embedded nats-server (0: a free one)", between(0, 65535), flag="--nats-port")
    ready_timeout_s: float = key(180.0, "give up when not ready after this long", positive, flag="--ready-timeout")
    http: bool = key(False, "also start the OpenAI-compatible HTTP frontend", flag="--http")
    engine_cpus: str = key("auto", "auto: each prefill and decode process gets cores of its own (decode's the "
                                   "highest-numbered) when there is one for every engine thread, so one engine "
                                   "never preempts the other; the light services run anywhere. none: the OS places "
                                   "them. A worker.cpus set by hand wins", one_of("auto", "none"),
                           flag="--engine-cpus")
    fork_workers: bool = key(True, "start prefill and decode by forking one process that imported torch and "
                                   "Baton once (baton/launcher.py): ~1.5 s less CPU per start and restart. "
                                   "false: each as a fresh `python -m baton serve` process. The light services "
                                   "always start fresh (they never load torch)")


@dataclass(frozen=True)
class LogSection:
    level: str = key("INFO", "log level", lambda v: one_of("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")(v.upper()),
                     flag="--log-level")
    dir: str = key("baton-logs", "where `baton up` writes one log per service", flag="--log-dir")


@dataclass(frozen=True)
class MetricsSection:
    port: int = key(0, "Prometheus /metrics of `baton serve` on all interfaces: process metrics (CPU, memory, "
                    "GC); 0: off. The services' own metrics are on $BATON_PROMETHEUS_PORT (shared/metrics.py, "
                    "loopback); the HTTP frontend serves /metrics on its own port", between(0, 65535))


@dataclass(frozen=True)
class HealthSection:
    dir: str = key(tempfile.gettempdir(), "where `baton serve` keeps its health file for `baton health`")
    interval_s: float = key(5.0, "how often a service checks itself and refreshes the file", positive)
    max_age_s: float = key(20.0, "`baton health` fails when the file is older than this", positive)


@dataclass(frozen=True)
class Config:
    nats: NatsSection = NatsSection()
    model: ModelSection = ModelSection()
    router: RouterSection = RouterSection()
    registry: RegistrySection = RegistrySection()
    worker: WorkerSection = WorkerSection()
    http: HttpSection = HttpSection()
    up: UpSection = UpSection()
    log: LogSection = LogSection()
    metrics: MetricsSection = MetricsSection()
    health: HealthSection = HealthSection()
    # where each `section.key` that is not a default came from: "file PATH", "env NAME", "flag --x"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def get(self, dotted: str) -> Any:
        section, name = dotted.split(".", 1)
        return getattr(getattr(self, section), name)

    def source(self, dotted: str) -> str:
        return self.sources.get(dotted, "default")

    @property
    def model_name(self) -> str:
        return self.model.name or Path(self.model.path).name

    def http_api_keys(self) -> tuple[str, ...]:
        """Every key the HTTP frontend accepts (none: it asks for none). Raises ConfigError."""
        keys = [self.http.api_key] if self.http.api_key else []
        if self.http.api_key_file:
            try:
                lines = Path(self.http.api_key_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"http.api_key_file: {self.http.api_key_file}: {exc.strerror} "
                                  f"(from {self.source('http.api_key_file')})") from None
            file_keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not file_keys:
                raise ConfigError(f"http.api_key_file: {self.http.api_key_file} holds no key "
                                  f"(from {self.source('http.api_key_file')})")
            keys += file_keys
        return tuple(keys)

    def nats_options(self) -> dict[str, Any]:
        """Keyword arguments for `Bus.connect` (empty values left out)."""
        n = self.nats
        options = dict(user=n.user, password=n.password, token=n.token, creds_file=n.creds_file,
                       tls_ca_file=n.tls_ca_file, tls_cert_file=n.tls_cert_file, tls_key_file=n.tls_key_file)
        return {k: v for k, v in options.items() if v} | {"connect_timeout_s": n.connect_timeout_s}

    def nats_servers(self) -> str | list[str]:
        urls = [u.strip() for u in self.nats.url.split(",") if u.strip()]
        return urls[0] if len(urls) == 1 else urls


SECTIONS: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(Config) if f.name != "sources"}


def keys() -> dict[str, dataclasses.Field]:
    """Every `section.key` and its field (type, default, help, check, flag)."""
    return {f"{s}.{f.name}": f for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "_").upper()


FLAGS: dict[str, str] = {f.metadata["flag"]: k for k, f in keys().items() if f.metadata["flag"]}


# --- loading ---------------------------------------------------------------------------------
def load(file: str | Path | None = None, env: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> Config:
    """The effective config. `file`: a TOML path (None: $BATON_CONFIG, if set). `env`: the
    environment (None: os.environ). `flags`: `section.key` -> value for the CLI flags actually given
    (values from argparse, already typed), or `--flag` -> value. Raises ConfigError."""
    env = os.environ if env is None else env
    if file is None and env.get(CONFIG_ENV):
        file = env[CONFIG_ENV]
    layers: list[tuple[str, dict[str, Any], bool]] = []  # (source, values, values are strings)
    if file is not None:
        layers += _file_layers(Path(file))
    layers += _env_layers(env)
    for name, value in (flags or {}).items():
        if value is None:
            continue
        dotted = FLAGS.get(name, name)
        if dotted not in keys():
            raise ConfigError(f"unknown config key {name!r}")
        layers.append((f"flag {_flag_of(dotted)}", {dotted: value}, isinstance(value, str)))

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer, textual in layers:
        for dotted, raw in layer.items():
            values[dotted] = _coerce(dotted, raw, source, textual)
            sources[dotted] = source
    return _build(values, sources)


def _flag_of(dotted: str) -> str:
    return keys()[dotted].metadata["flag"] or dotted


def _file_layers(path: Path) -> list[tuple[str, dict[str, Any], bool]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    known = keys()
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section in {path} (sections: {', '.join(SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: must be a table ([{section}]) in {path}")
        for name, value in table.items():
            dotted = f"{section}.{name}"
            if dotted not in known:
                raise ConfigError(f"{dotted}: unknown key in {path} (keys of [{section}]: "
                                  f"{', '.join(f.name for f in dataclasses.fields(SECTIONS[section]))})")
            flat[dotted] = value
    return [(f"file {path}", flat, False)]


def _env_layers(env: Mapping[str, str]) -> list[tuple[str, dict[str, Any], bool]]:
    known = keys()
    layers = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        section, _, rest = name[len(ENV_PREFIX):].lower().partition("_")
        if section not in SECTIONS or not rest:
            continue  # not configuration (BATON_CONFIG, BATON_STATE, BATON_TRANSFER_FAULTS, ...)
        dotted = f"{section}.{rest}"
        if dotted not in known:
            raise ConfigError(f"{name}: no config key {dotted} (keys of [{section}]: "
                              f"{', '.join(f.name for f in dataclasses.fields(SECTIONS[section]))})")
        layers.append((f"env {name}", {dotted: env[name]}, True))
    return layers


TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _coerce(dotted: str, raw: Any, source: str, textual: bool) -> Any:
    """`raw` as the key's type: strings (env, flags) are parsed; typed values (TOML) are checked."""
    kind = type_of(dotted)
    where = f"(from {source})"
    if isinstance(raw, Path):
        raw = str(raw)
    if textual and kind is not str:
        text = raw.strip()
        try:
            if kind is bool:
                if text.lower() not in TRUE | FALSE:
                    raise ValueError
                return text.lower() in TRUE
            return kind(text)
        except ValueError:
            raise ConfigError(f"{dotted}: expected {kind.__name__}, got {raw!r} {where}") from None
    ok = (isinstance(raw, kind) and not (kind is int and isinstance(raw, bool))) or \
         (kind is float and isinstance(raw, int) and not isinstance(raw, bool))
    if not ok:
        raise ConfigError(f"{dotted}: expected {kind.__name__}, got {type(raw).__name__} {raw!r} {where}")
    return float(raw) if kind is float else raw


def type_of(dotted: str) -> type:
    """The key's Python type (str, int, float or bool)."""
    annotation = keys()[dotted].type
    return {"str": str, "int": int, "float": float, "bool": bool}[annotation] if isinstance(annotation, str) \
        else annotation


def _build(values: dict[str, Any], sources: dict[str, str]) -> Config:
    sections = {}
    for section, cls in SECTIONS.items():
        given = {k.split(".", 1)[1]: v for k, v in values.items() if k.split(".", 1)[0] == section}
        sections[section] = cls(**given)
    config = Config(**sections, sources=dict(sources))
    for section in SECTIONS:
        check_section(getattr(config, section), config.sources)
    for a, b in (("nats.tls_cert_file", "nats.tls_key_file"),):
        if bool(config.get(a)) != bool(config.get(b)):
            raise ConfigError(f"{b if config.get(a) else a}: must be set together with "
                              f"{a if config.get(a) else b}")
    if config.nats.password and not config.nats.user:
        raise ConfigError(f"nats.user: must be set when nats.password is (from {config.source('nats.password')})")
    if not Path(config.model.path).is_dir():
        raise ConfigError(f"model.path: no such directory: {config.model.path} (from {config.source('model.path')})")
    config.http_api_keys()  # a key file that cannot be read, or is empty, stops the start (fail closed)
    return config


def check_section(values: Any, sources: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for the first key of `values` (a section, e.g. `WorkerSection(...)`) that
    fails its check. The message names where the value came from (`sources`, as `Config.sources`);
    with None the section was built in code, and no source is named."""
    section = next(name for name, cls in SECTIONS.items() if type(values) is cls)
    for f in dataclasses.fields(values):
        check = f.metadata["check"]
        problem = check(getattr(values, f.name)) if check else None
        if problem:
            dotted = f"{section}.{f.name}"
            where = "" if sources is None else f" (from {sources.get(dotted, 'default')})"
            raise ConfigError(f"{dotted}: {problem}{where}")


# --- showing ---------------------------------------------------------------------------------
def as_dict(config: Config, reveal: bool = False) -> dict[str, dict[str, Any]]:
    """Plain nested dict of the effective values; secrets masked unless `reveal`."""
    out: dict[str, dict[str, Any]] = {}
    for dotted, f in keys().items():
        section, name = dotted.split(".", 1)
        value = config.get(dotted)
        if f.metadata["secret"] and value and not reveal:
            value = "***"
        out.setdefault(section, {})[name] = value
    return out


def to_toml(config: Config, reveal: bool = False) -> str:
    """The effective config as a TOML file, each key commented with its help and source."""
    lines = ["# effective Baton configuration (defaults < file < environment < flags)"]
    plain = as_dict(config, reveal)
    for section, values in plain.items():
        lines += ["", f"[{section}]"]
        for name, value in values.items():
            dotted = f"{section}.{name}"
            f = keys()[dotted]
            source = config.source(dotted)
            flag = f" | {f.metadata['flag']}" if f.metadata["flag"] else ""
            lines.append(f"{name} = {json.dumps(value)}  # {f.metadata['help']} [{source}; {env_name(dotted)}{flag}]")
    return "\n".join(lines) + "\n"
