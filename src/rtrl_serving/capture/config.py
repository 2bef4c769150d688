"""The sidecar's settings: flags, each with an environment fallback (the operator sets env).

The flags and variables are the sidecar contract (docs/writing-shards.md, "Capture"); those
past it (segment size and age, the spool's limit, the generation config, the tool-call
markers, the clock header) have defaults that suit a pod and exist for tuning and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rtrl import __version__
from rtrl.core.store import parse_store_uri
from rtrl_serving.spool import (
    DEFAULT_COMMIT_MS,
    DEFAULT_MAX_BYTES,
    DEFAULT_SEGMENT_AGE_S,
    DEFAULT_SEGMENT_BYTES,
)

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
ARMS = ("stable", "canary")
DEFAULT_MARKERS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]")


class ConfigError(ValueError):
    """A setting with a bad value; the message names the flag and its variable."""


@dataclass(frozen=True)
class CaptureConfig:
    listen_host: str
    listen_port: int
    engine: str  # base URL, no trailing slash
    events: str  # events root URI
    spool: str
    commit_ms: float
    user_header: str
    session_header: str
    org_header: str
    logprobs_mode: str
    serving_dtype: str | None
    checkpoint_id: str | None
    model_uri: str | None
    arm: str | None
    rlcycle: str | None
    pod: str
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    segment_age_s: float = DEFAULT_SEGMENT_AGE_S
    max_spool_bytes: int = DEFAULT_MAX_BYTES
    generation_config: str = "auto"
    override_generation_config: Mapping[str, object] = field(default_factory=dict)
    tool_call_markers: tuple[str, ...] = DEFAULT_MARKERS
    clock_header: str | None = None
    drain_timeout_s: float = 25.0
    verify_interval_s: float = 30.0
    adapters: str | None = None  # the routing table's file or directory (adapters.py); None: off
    adapter_dir: str = "/var/lib/rtrl-adapters"
    # the same table's ConfigMap, followed through the API ahead of the mounted --adapters
    adapters_configmap: str | None = None


# (flag, env, default, help)
_FLAGS: tuple[tuple[str, str, str | None, str], ...] = (
    ("--listen", "RTRL_CAPTURE_LISTEN", "0.0.0.0:8081", "host:port to serve clients on"),
    ("--engine", "RTRL_CAPTURE_ENGINE", "http://127.0.0.1:8000", "the engine's base URL"),
    ("--events", "RTRL_CAPTURE_EVENTS", None,
     "events root URI (s3:// or file://); generation events go under generations/"),
    ("--spool", "RTRL_CAPTURE_SPOOL", "/var/spool/rtrl-capture", "local spool directory"),
    ("--commit-ms", "RTRL_CAPTURE_COMMIT_MS", str(DEFAULT_COMMIT_MS),
     "group-commit window of the spool: fsync at most this often (milliseconds)"),
    ("--user-header", "RTRL_CAPTURE_USER_HEADER", "X-Rtrl-User", "header naming the user"),
    ("--session-header", "RTRL_CAPTURE_SESSION_HEADER", "X-Rtrl-Session",
     "header naming the session"),
    ("--org-header", "RTRL_CAPTURE_ORG_HEADER", "X-Rtrl-Org", "header naming the org"),
    ("--logprobs-mode", "RTRL_CAPTURE_LOGPROBS_MODE", "raw_logprobs",
     "the engine's --logprobs-mode"),
    ("--serving-dtype", "RTRL_CAPTURE_SERVING_DTYPE", None,
     "the engine's weights dtype as served (float32, bfloat16)"),
    ("--segment-bytes", "RTRL_CAPTURE_SEGMENT_BYTES", str(DEFAULT_SEGMENT_BYTES),
     "close a spool segment at this size"),
    ("--segment-age-s", "RTRL_CAPTURE_SEGMENT_AGE_S", str(DEFAULT_SEGMENT_AGE_S),
     "close a spool segment this long after its first event (events ship within about this)"),
    ("--max-spool-bytes", "RTRL_CAPTURE_MAX_SPOOL_BYTES", str(DEFAULT_MAX_BYTES),
     "the spool's limit; past it new events are dropped and counted, serving goes on"),
    ("--generation-config", "RTRL_CAPTURE_GENERATION_CONFIG", "auto",
     "the engine's --generation-config: auto (the model's generation_config.json), vllm "
     "(none), or a directory or URI holding one"),
    ("--override-generation-config", "RTRL_CAPTURE_OVERRIDE_GENERATION_CONFIG", "{}",
     "the engine's --override-generation-config (JSON)"),
    ("--tool-call-markers", "RTRL_CAPTURE_TOOL_CALL_MARKERS", ",".join(DEFAULT_MARKERS),
     "comma-separated text that starts a tool call; found in a reply's content it is a tool "
     "call the engine's parser could not parse, counted invalid"),
    ("--clock-header", "RTRL_CAPTURE_CLOCK_HEADER", None,
     "FOR SIMULATIONS ONLY: take each request's serving time from this header (ISO 8601 or "
     "Unix seconds) instead of the clock; off by default"),
    ("--drain-timeout-s", "RTRL_CAPTURE_DRAIN_TIMEOUT_S", "25",
     "on SIGTERM: how long to wait for in-flight requests and the last uploads"),
    ("--adapters", "RTRL_CAPTURE_ADAPTERS", None,
     "a file routing organisations to LoRA adapters in the engine (YAML or JSON: orgs: "
     "{ORG: {stable, canary, weight}}), or a directory of such files (*.yaml, *.yml, *.json; "
     "a mounted ConfigMap, one key per RLCycle) whose union is the table; followed as it "
     "changes; off by default"),
    ("--adapter-dir", "RTRL_CAPTURE_ADAPTER_DIR", "/var/lib/rtrl-adapters",
     "where routed adapters are downloaded: a directory the engine reads too"),
    ("--adapters-configmap", "RTRL_CAPTURE_ADAPTERS_CONFIGMAP", None,
     "the ConfigMap (of the pod's namespace) mounted as --adapters: followed through the "
     "Kubernetes API with the pod's ServiceAccount (get, list, watch on it), so a changed "
     "route arrives in under a second rather than at the kubelet's next sync; the mounted "
     "table while the API cannot be read"),
)  # fmt: skip


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> CaptureConfig:
    """The settings from ``argv`` (flags win) and ``env``; a :class:`ConfigError` names the
    bad one."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="rtrl-capture",
        description="The capture sidecar: an OpenAI-API proxy in front of the inference engine "
        "that records every generation as an event (docs/writing-shards.md, Capture).",
    )
    parser.add_argument("--version", action="version", version=f"rtrl-capture {__version__}")
    for flag, var, default, text in _FLAGS:
        parser.add_argument(flag, default=env.get(var, default),
                            help=f"{text} (env {var}; default {default})")  # fmt: skip
    args = parser.parse_args(argv)

    def fail(flag: str, problem: str) -> ConfigError:
        var = next(v for f, v, _, _ in _FLAGS if f == flag)
        return ConfigError(f"{flag} (env {var}): {problem}")

    host, sep, port_text = str(args.listen).rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise fail("--listen", f"{args.listen!r} is not host:port")
    engine = str(args.engine).rstrip("/")
    if not engine.startswith(("http://", "https://")):
        raise fail("--engine", f"{engine!r} is not an http(s):// URL")
    if not args.events:
        raise fail(
            "--events", "the events root URI is required (s3://bucket/prefix/ or file:///dir/)"
        )
    try:
        parse_store_uri(str(args.events))
    except ValueError as exc:
        raise fail("--events", str(exc)) from None

    def number(flag: str, value: str, *, low: float) -> float:
        try:
            parsed = float(value)
        except ValueError:
            raise fail(flag, f"{value!r} is not a number") from None
        if not parsed >= low:
            raise fail(flag, f"{value} is below {low}")
        return parsed

    mode = str(args.logprobs_mode)
    if mode not in LOGPROBS_MODES:
        raise fail("--logprobs-mode", f"{mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
    try:
        override = json.loads(args.override_generation_config or "{}")
    except ValueError as exc:
        raise fail("--override-generation-config", f"not JSON ({exc})") from None
    if not isinstance(override, dict):
        raise fail("--override-generation-config", "must be a JSON object")
    arm = env.get("RTRL_ARM") or None
    if arm is not None and arm not in ARMS:
        raise ConfigError(f"RTRL_ARM: {arm!r} is not one of {', '.join(ARMS)}")
    markers = tuple(m for m in str(args.tool_call_markers).split(",") if m)
    if args.adapters_configmap and not args.adapters:
        raise ConfigError(
            "--adapters-configmap: needs --adapters, the same table mounted, which the sidecar "
            "follows while the API cannot be read"
        )
    return CaptureConfig(
        listen_host=host,
        listen_port=int(port_text),
        engine=engine,
        events=str(args.events),
        spool=str(args.spool),
        commit_ms=number("--commit-ms", args.commit_ms, low=0),
        user_header=str(args.user_header),
        session_header=str(args.session_header),
        org_header=str(args.org_header),
        logprobs_mode=mode,
        serving_dtype=args.serving_dtype or None,
        checkpoint_id=env.get("RTRL_CHECKPOINT_ID") or None,
        model_uri=env.get("RTRL_MODEL_URI") or None,
        arm=arm,
        rlcycle=env.get("RTRL_RLCYCLE") or None,
        pod=env.get("POD_NAME") or socket.gethostname(),
        segment_bytes=int(number("--segment-bytes", args.segment_bytes, low=1)),
        segment_age_s=number("--segment-age-s", args.segment_age_s, low=0.001),
        max_spool_bytes=int(number("--max-spool-bytes", args.max_spool_bytes, low=1)),
        generation_config=str(args.generation_config),
        override_generation_config=override,
        tool_call_markers=markers,
        clock_header=args.clock_header or None,
        drain_timeout_s=number("--drain-timeout-s", args.drain_timeout_s, low=0),
        adapters=args.adapters or None,
        adapter_dir=str(args.adapter_dir),
        adapters_configmap=args.adapters_configmap or None,
    )
