"""The demo's deployment: a model server and a real ``rtrl-capture`` sidecar per arm, and one
real ``rtrl-feedback`` service, kept up across the demo's ticks as a deployment stays up.

Each arm is what a pod of the target (or canary) Deployment runs: the model server on its
engine port and the sidecar in front of it, the sidecar started with the env the operator
put in the pod template (``spec.capture``: events root, headers, ``RTRL_CHECKPOINT_ID``,
``RTRL_MODEL_URI``, ``RTRL_ARM``), rewritten only where a local process must differ from a
pod (its ports, its spool directory, its pod name) plus the simulation's clock header. An
arm whose checkpoint is no longer served is stopped as a pod is deleted: SIGTERM, and the
sidecar drains and ships its spool before it exits.

The model servers are :class:`rtrl_demo.engine.ModelServer` threads of this process (the
demo's serving fleet), so torch is imported once; the sidecars and the feedback service are
processes of their own, as in a deployment.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl_localkube.podprocess import BIN, tail
from rtrl_localkube.processes import die_with_parent, free_port, kill_group

from .engine import ModelServer, ServerThread

READY_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 60.0
CLOCK_HEADER = "X-Rtrl-Simulated-Time"
# Segments close this often (real seconds): a tick's events reach the store right after it.
SEGMENT_AGE_S = 0.5
# Values a local process must hold instead of the pod's.
LOCAL_ENV = ("RTRL_CAPTURE_LISTEN", "RTRL_CAPTURE_ENGINE", "RTRL_CAPTURE_SPOOL", "POD_NAME",
             "TMPDIR", "RTRL_CAPTURE_CLOCK_HEADER", "RTRL_CAPTURE_SEGMENT_AGE_S")  # fmt: skip


# spec.capture.adapters: the sidecar's routing table (the ConfigMap's volume) and the
# adapters' directory (the pod's own volume, shared with the engine), as local directories
ADAPTERS_TABLE_ENV, ADAPTER_DIR_ENV = "RTRL_CAPTURE_ADAPTERS", "RTRL_CAPTURE_ADAPTER_DIR"


def adapters_table_dir(work: Path) -> Path:
    """Where the routing table's ConfigMap volume lies for the arms of an inlet on ``work``:
    the demo writes the ConfigMap's keys there as the kubelet does
    (:func:`rtrl_localkube.configmapvolume.project`), every arm's sidecar reads it."""
    return work / "volumes" / "rtrl-capture-adapters"


class InletError(RuntimeError):
    """A process of the inlet did not start or stop as it should; the message holds its log."""


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


def metric(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in Prometheus text."""
    found = re.search(rf"^{re.escape(name)} ([-+0-9.eEinfa]+)$", text, re.MULTILINE)
    return float(found[1]) if found else None


def tables_taken(text: str) -> float:
    """The routing tables a sidecar applied or refused (``rtrl_capture_adapter_tables``)."""
    found = re.findall(
        r'^rtrl_capture_adapter_tables_total\{result="(?:applied|refused)"\} ([0-9.eE+]+)$',
        text,
        re.MULTILINE,
    )
    return sum(float(v) for v in found)


def _wait(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():
        if proc.poll() is not None:
            raise InletError(f"{what} exited {proc.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise InletError(f"{what} not ready after {READY_TIMEOUT_S:.0f}s:\n{tail(log)}")
        time.sleep(0.1)


def _start(argv: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            die_with_parent(argv, "TERM"), env=dict(env), stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    """SIGTERM and wait for the drain; a process that does not exit in time is killed and
    reported, as is one that exits non-zero (a sidecar that could not ship its spool)."""
    kill_group(proc, grace=DRAIN_TIMEOUT_S)
    if proc.returncode not in (0, -15):
        raise InletError(f"{what} exited {proc.returncode} when stopped:\n{tail(log)}")


@dataclass
class Arm:
    """One serving pod's worth: the model server and its capture sidecar."""

    key: tuple[str, str, str]  # checkpoint id, model URI, arm
    engine_port: int
    url: str  # the sidecar's base URL: what clients call
    name: str  # the served model's name
    proc: subprocess.Popen[bytes]
    log: Path
    follows_table: bool = False  # spec.capture.adapters: its sidecar routes orgs to adapters
    table: tuple[tuple[str, bytes], ...] | None = None  # the table it was last seen to take
    tables_taken: float = 0.0  # its tables applied or refused, then


class Inlet:
    """The arms being served and the feedback service, started on demand."""

    def __init__(
        self, work: Path, env: Mapping[str, str], segment_age_s: float = SEGMENT_AGE_S
    ) -> None:
        self.work = work
        self.segment_age_s = segment_age_s
        self.env = dict(env)
        self.servers = ServerThread()
        self.arms: dict[tuple[str, str, str], Arm] = {}
        self.feedback: tuple[subprocess.Popen[bytes], str, Path] | None = None
        self.token = ""
        self.events = ""

    # --- the feedback service ----------------------------------------------------------

    def feedback_service(self, events: str) -> tuple[str, str]:
        """``rtrl-feedback`` on ``events`` (started once): its base URL and a token."""
        if self.feedback is not None and self.feedback[0].poll() is None:
            if events != self.events:
                raise InletError(f"the feedback service writes to {self.events}, not {events}")
            return self.feedback[1], self.token
        self.events = events
        tokens = self.work / "feedback-tokens"
        tokens.parent.mkdir(parents=True, exist_ok=True)
        if not self.token:
            self.token = secrets.token_hex(32)
            tokens.touch(mode=0o600)
            tokens.write_text(self.token + "\n")
        port = free_port()
        log = self.work / "logs" / "rtrl-feedback.log"
        argv = [str(BIN / "rtrl-feedback"), f"--listen=127.0.0.1:{port}", f"--events={events}",
                f"--token-file={tokens}"]  # fmt: skip
        proc = _start(argv, self.env, log)
        url = f"http://127.0.0.1:{port}"
        _wait("rtrl-feedback", lambda: _get(f"{url}/readyz")[0] == 200, proc, log)
        self.feedback = (proc, url, log)
        return url, self.token

    # --- the arms ----------------------------------------------------------------------

    def arm(
        self,
        checkpoint: str,
        uri: str,
        arm: str,
        sidecar_env: Mapping[str, str],
        load: Callable[[str], Any],
    ) -> Arm:
        """The arm serving ``checkpoint`` (``uri``) on ``arm`` (stable or canary), started
        if it is not up: ``load(uri)`` gives the model; ``sidecar_env`` is the pod
        template's env of the ``rtrl-capture`` container."""
        key = (checkpoint, uri, arm)
        held = self.arms.get(key)
        if held is not None and held.proc.poll() is None:
            return held
        if held is not None:
            self.retire(key)
        name = checkpoint
        engine_port = self.servers.start(ModelServer(load(uri), uri, name), free_port())
        port = free_port()
        spool = self.work / "spool" / f"{checkpoint}-{arm}"
        log = self.work / "logs" / f"rtrl-capture-{checkpoint}-{arm}.log"
        env = {k: v for k, v in sidecar_env.items() if k not in LOCAL_ENV}
        env.update(
            RTRL_CAPTURE_LISTEN=f"127.0.0.1:{port}",
            RTRL_CAPTURE_ENGINE=f"http://127.0.0.1:{engine_port}",
            RTRL_CAPTURE_SPOOL=str(spool),
            RTRL_CAPTURE_CLOCK_HEADER=CLOCK_HEADER,
            RTRL_CAPTURE_SEGMENT_AGE_S=str(self.segment_age_s),
            POD_NAME=f"demo-{checkpoint}-{arm}",
        )
        if ADAPTERS_TABLE_ENV in env:  # the pod's volumes, as local directories
            env[ADAPTERS_TABLE_ENV] = str(adapters_table_dir(self.work))
            env[ADAPTER_DIR_ENV] = str(self.work / "volumes" / f"rtrl-adapters-{checkpoint}-{arm}")
        proc = _start([str(BIN / "rtrl-capture")], {**self.env, **env}, log)
        url = f"http://127.0.0.1:{port}"

        def verified() -> bool:
            # every event must be checkpoint_verified, or the seal quarantines it
            status, text = _get(f"{url}/metrics")
            return status == 200 and metric(text, "rtrl_capture_checkpoint_verified") == 1.0

        try:
            _wait(f"rtrl-capture for {checkpoint} ({arm})", verified, proc, log)
        except InletError:
            kill_group(proc)
            self.servers.stop(engine_port)
            raise
        self.arms[key] = Arm(key, engine_port, url, name, proc, log, ADAPTERS_TABLE_ENV in env)
        return self.arms[key]

    def follow_table(self) -> None:
        """Wait until every arm's sidecar has taken the routing table as it lies now (it
        polls the directory every second, loads the adapters, then applies it whole), so
        that the users of the tick are routed by it; a table it refused counts as taken (the
        previous one stays, as in a pod)."""
        table = adapters_table_dir(self.work)
        now = tuple(
            (p.name, p.read_bytes())
            for p in sorted(table.iterdir()) if not p.name.startswith(".") and p.is_file()
        ) if table.is_dir() else ()  # fmt: skip
        for held in self.arms.values():
            if not held.follows_table or held.table == now:
                continue
            before = held.tables_taken

            def took(held: Any = held, before: float = before) -> tuple[bool, str]:
                taken = tables_taken(_get(f"{held.url}/metrics")[1])
                held.tables_taken = max(held.tables_taken, taken)
                return taken > before, f" did not take the routing table in {READY_TIMEOUT_S:.0f}s"

            _await(held, took, READY_TIMEOUT_S)
            held.table = now

    def retire(self, key: tuple[str, str, str]) -> None:
        """Stop an arm as its pod is deleted: the sidecar drains and ships, then exits."""
        held = self.arms.pop(key)
        try:
            _stop(held.proc, f"rtrl-capture for {key[0]} ({key[2]})", held.log)
        finally:
            self.servers.stop(held.engine_port)

    def keep_only(self, keys: set[tuple[str, str, str]]) -> None:
        for key in [k for k in self.arms if k not in keys]:
            self.retire(key)

    def drain(self) -> None:
        """Wait until every arm's sidecar has shipped every event it took: what a tick
        served is in the events store before the seal may read it."""
        for held in self.arms.values():

            def shipped_all(held: Any = held) -> tuple[bool, str]:
                status, text = _get(f"{held.url}/metrics")
                spooled = metric(text, "rtrl_capture_events_spooled_total")
                shipped = metric(text, "rtrl_capture_events_shipped_total")
                done = status == 200 and spooled is not None and spooled == shipped
                return done, f": {shipped} of {spooled} events shipped after {DRAIN_TIMEOUT_S:.0f}s"

            _await(held, shipped_all, DRAIN_TIMEOUT_S)

    def close(self) -> None:
        errors = []
        for key in list(self.arms):
            try:
                self.retire(key)
            except InletError as exc:
                errors.append(str(exc))
        if self.feedback is not None:
            proc, _, log = self.feedback
            self.feedback = None
            with contextlib.suppress(InletError):
                _stop(proc, "rtrl-feedback", log)
        self.servers.close()
        if errors:
            raise InletError("\n".join(errors))


def sidecar_env(container: Mapping[str, Any] | None) -> dict[str, str]:
    """The plain values of a pod template container's env (``valueFrom`` entries are the
    kubelet's to fill: the demo sets those it needs itself)."""
    out = {}
    for entry in (container or {}).get("env") or []:
        if "value" in entry:
            out[str(entry["name"])] = str(entry["value"])
    return out


def _await(held: Any, probe: Callable[[], tuple[bool, str]], timeout: float) -> None:
    """Poll ``probe`` (whether it is done, and what did not happen if it never is) until it
    is done; an InletError when the sidecar exits or ``timeout`` passes first, with the
    sidecar's last log lines."""
    deadline = time.monotonic() + timeout
    while True:
        done, missing = probe()
        if done:
            return
        if held.proc.poll() is not None:
            raise InletError(f"rtrl-capture for {held.key[0]} exited:\n{tail(held.log)}")
        if time.monotonic() > deadline:
            raise InletError(f"rtrl-capture for {held.key[0]}{missing}:\n{tail(held.log)}")
        time.sleep(0.05)
