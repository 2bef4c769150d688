"""The one native op DeepSpeed compiles on CPU (its shared-memory collectives), built once
and loaded without ever waiting on a lock nobody will release.

DeepSpeed builds ``deepspeed_shm_comm`` with torch's JIT loader the first time a process
group starts on CPU (20-40 s of g++). torch guards that build with a plain lock *file*
(``<dir>/lock``, created with O_EXCL, removed when the build ends) and every other process
waits for it in a sleep loop with no timeout. A process killed during the build leaves the
file behind, and from then on every training in that environment sleeps forever with an
empty log. So rtrl does not go through that path once the op is built:

- :func:`ensure_shm_op` imports the built library directly (as torch's loader would after
  its build) when a stamp next to it matches this environment: DeepSpeed's version, torch's,
  Python's and the op's sources and flags. No lock file is touched on that path.
- Otherwise it builds, under an ``flock`` of its own (the kernel releases it when the holder
  dies, however it dies), with a bounded wait that says which process it waits for. A torch
  lock file that no live process holds open is a dead build's: it is removed with a warning.
- ``make install`` and the trainer image build it ahead of time (``python -m
  rtrl_trainer.train.cpu_ops``), so no test and no pod pays the compile, and none can be
  killed during it. ``RTRL_PREBUILT_TORCH_EXTENSIONS`` names such a prebuilt directory
  (read-only is fine: the library is imported in place).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

OP = "ShareMemCommBuilder"
STAMP = "rtrl-build.json"
PREBUILT_ENV = "RTRL_PREBUILT_TORCH_EXTENSIONS"
TIMEOUT_ENV = "RTRL_OP_BUILD_TIMEOUT"
# Longer than any build of this op takes on a loaded machine (20-40 s measured, minutes on
# a starved 2-core CI box): a lock file older than this, or a wait longer, is not a build.
DEFAULT_TIMEOUT_S = 900.0
_REPORT_EVERY_S = 30.0


class OpBuildError(RuntimeError):
    """The op could not be built or loaded; the message says why and where."""


def extensions_root() -> Path:
    """Where torch's JIT loader builds extensions in this process (TORCH_EXTENSIONS_DIR, or
    torch's default under ~/.cache)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("x", verbose=False)).parent


def use_environment_extensions() -> None:
    """Build extensions in this Python environment (``<venv>/torch_extensions``) unless
    TORCH_EXTENSIONS_DIR says otherwise or the environment is read-only: the op is then
    built once per environment, by ``make install``, not per user cache."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        cache = Path(sys.prefix) / "torch_extensions"
        if os.access(cache if cache.is_dir() else Path(sys.prefix), os.W_OK):
            os.environ["TORCH_EXTENSIONS_DIR"] = str(cache)


def _builder() -> Any | None:
    """DeepSpeed's builder of the op, or None where it is not used (not Linux, a GPU
    accelerator)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(OP)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def fingerprint(builder: Any) -> dict[str, Any]:
    """What a built library must match to be loaded without asking torch: the versions it
    was compiled against, its sources' contents and its flags."""
    import deepspeed
    import torch

    sources = hashlib.sha256()
    for path in sorted(builder.sources()) + sorted(builder.include_paths()):
        full = Path(builder.deepspeed_src_path(path))
        files = sorted(full.rglob("*")) if full.is_dir() else [full]
        for file in files:
            if file.is_file():
                sources.update(file.name.encode() + b"\0" + file.read_bytes())
    return {
        "op": builder.NAME,
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "platform": sys.platform,
        "cxx_args": builder.strip_empty_entries(builder.cxx_args()),
        "sources_sha256": sources.hexdigest(),
    }


def _stamped(directory: Path, expected: dict[str, Any]) -> Path | None:
    """The built library in ``directory`` if its stamp matches ``expected``."""
    library = directory / f"{expected['op']}.so"
    try:
        stamp = json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return library if stamp == expected and library.is_file() else None


def _import(name: str, library: Path) -> ModuleType:
    """Import a built extension from its file, as torch's loader does after a build."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _register(builder: Any, module: ModuleType) -> ModuleType:
    # DeepSpeed's loaders (OpBuilder.load, called by its CPU backend) return what this
    # class-wide cache holds for the op's name before anything else.
    builder._loaded_ops[builder.NAME] = module
    return module


def ensure_shm_op(timeout: float | None = None, say: Any = None) -> ModuleType | None:
    """Load DeepSpeed's CPU shared-memory op, building it first if no matching build exists.

    Returns the module (None where the op is not used). Raises :class:`OpBuildError` when a
    live build by another process does not end within ``timeout`` seconds, or the build
    fails. ``say`` receives progress lines (default: stderr)."""
    tell = say or (lambda text: print(text, file=sys.stderr, flush=True))
    builder = _builder()
    if builder is None:
        return None
    if builder.NAME in builder._loaded_ops:
        return builder._loaded_ops[builder.NAME]  # type: ignore[no-any-return]
    expected = fingerprint(builder)
    for directory in _candidates(builder.NAME):
        library = _stamped(directory, expected)
        if library is not None:
            with contextlib.suppress(ImportError):
                return _register(builder, _import(builder.NAME, library))
    limit = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)) if timeout is None else timeout
    root = extensions_root()
    directory = root / builder.NAME
    with _build_lock(root / f".{builder.NAME}.rtrl-lock", limit, tell):
        library = _stamped(directory, expected)  # built by the holder we waited for
        if library is not None:
            with contextlib.suppress(ImportError):
                return _register(builder, _import(builder.NAME, library))
        _clear_dead_build(directory / "lock", limit, tell)
        started = time.time()
        tell(f"building DeepSpeed's {builder.NAME} op in {directory} (once per environment)")
        try:
            with contextlib.redirect_stdout(sys.stderr):
                module = builder.jit_load(verbose=False)
        except Exception as exc:
            raise OpBuildError(f"building {builder.NAME} in {directory} failed: {exc}") from exc
        _write_stamp(directory, expected)
        tell(f"built {builder.NAME} in {time.time() - started:.1f}s")
        return _register(builder, module)


def _candidates(name: str) -> Iterator[Path]:
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        yield Path(prebuilt) / name
    yield extensions_root() / name


def _write_stamp(directory: Path, expected: dict[str, Any]) -> None:
    tmp = directory / f".{STAMP}.{os.getpid()}"
    tmp.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, directory / STAMP)


@contextlib.contextmanager
def _build_lock(path: Path, timeout: float, tell: Any) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: released by the kernel when its holder exits or
    is killed, so it can never go stale. The holder's pid is written into the file for the
    waiting message."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        next_report = time.monotonic() + _REPORT_EVERY_S
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            now = time.monotonic()
            holder = _read_pid(fd)
            if now >= deadline:
                raise OpBuildError(
                    f"waited {timeout:.0f}s for process {holder or '?'} to finish building "
                    f"in {path.parent} (lock {path}); set {TIMEOUT_ENV} to wait longer"
                )
            if not waited or now >= next_report:
                tell(f"waiting for process {holder or '?'} building in {path.parent}")
                next_report = now + _REPORT_EVERY_S
                waited = True
            time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or "0") or None
    return None


def lock_holders(lock: Path) -> list[int] | None:
    """The pids of the processes holding ``lock`` open (torch's loader keeps the lock file's
    descriptor open for the whole build), or None when some process's descriptors could
    not be read (another user's): then nobody can tell."""
    target = os.fspath(lock.resolve()) if lock.exists() else os.fspath(lock)
    holders: list[int] = []
    unknown = False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        holders.append(int(entry.name))
                        break
        except PermissionError:
            unknown = True
        except OSError:
            continue  # the process ended while we looked
    return holders if holders or not unknown else None


def _clear_dead_build(lock: Path, timeout: float, tell: Any) -> None:
    """Remove torch's build lock file when the build that made it is dead; wait (bounded)
    while a live process holds it."""
    deadline = time.monotonic() + timeout
    while lock.exists():
        holders = lock_holders(lock)
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if holders == [] or (holders is None and age > timeout):
            warnings.warn(
                f"removing {lock}: left by a build that was killed ({age:.0f}s old, no "
                "process holds it); building again",
                RuntimeWarning,
                stacklevel=3,
            )
            tell(f"removed a dead build's lock file {lock} ({age:.0f}s old)")
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            return
        if time.monotonic() >= deadline:
            raise OpBuildError(
                f"waited {timeout:.0f}s for process(es) {holders or '?'} building in "
                f"{lock.parent} (lock file {lock}); set {TIMEOUT_ENV} to wait longer"
            )
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """``python -m rtrl_trainer.train.cpu_ops``: build the op now (``make install``, the
    trainer image), or say it is built."""
    del argv
    os.environ["DS_ACCELERATOR"] = "cpu"
    use_environment_extensions()
    started = time.time()
    try:
        module = ensure_shm_op()
    except OpBuildError as exc:
        print(f"rtrl_trainer.train.cpu_ops: {exc}", file=sys.stderr)
        return 1
    if module is None:
        print("DeepSpeed's CPU shared-memory op is not used here (not Linux, or a GPU build)")
    else:
        print(f"DeepSpeed's CPU shared-memory op is ready ({time.time() - started:.1f}s): "
              f"{module.__file__}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
