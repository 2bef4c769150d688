"""DeepSpeed's one CPU op: built once when the environment is made, and a build killed
midway never stops a later training (before cpu_ops.py, every later ``rtrl-job train``
slept forever on the lock file the killed build left: a fresh clone's `make test` hung).

The kill test runs a real build in an extensions directory of its own, kills its process
group while g++ runs, as a pod's deletion does, then runs a real ``rtrl-job train`` (DeepSpeed
on CPU, a tiny GPT-2) on that directory and expects it to finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rtrl.core.store import open_store
from tests.conftest import REPO, console_script
from tests.rtrl_trainer.trainset import pattern_rows, save_parent, tiny_gpt2, write_trainset

OP = "deepspeed_shm_comm"
TRAIN = [
    "--precision", "fp32", "--batch-tokens", "64", "--micro-batch-size", "4", "--max-steps", "1",
]  # fmt: skip
PROBE = """
import json, sys
from pathlib import Path
import os
os.environ["DS_ACCELERATOR"] = "cpu"
from rtrl_trainer.train import cpu_ops
cpu_ops.use_environment_extensions()
builder = cpu_ops._builder()
directory = Path(sys.prefix) / "torch_extensions" / builder.NAME
print(json.dumps({"dir": str(directory),
                  "stamped": str(cpu_ops._stamped(directory, cpu_ops.fingerprint(builder)))}))
"""


def _env(extensions: Path) -> dict[str, str]:
    return dict(
        os.environ, TORCH_EXTENSIONS_DIR=str(extensions), DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"
    )


def test_the_environment_holds_the_built_op() -> None:
    """`make install` builds the op into the venv (python -m rtrl_trainer.train.cpu_ops), so
    no test or training compiles it: its stamp matches this environment."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["stamped"] != "None", (
        f"no build of {OP} matching this environment in {found['dir']}: `make install` "
        "runs `python -m rtrl_trainer.train.cpu_ops`"
    )


def _kill_a_build_midway(extensions: Path) -> None:
    build = subprocess.Popen(
        [sys.executable, "-m", "rtrl_trainer.train.cpu_ops"],
        env=_env(extensions),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    lock = extensions / OP / "lock"
    deadline = time.monotonic() + 120
    try:
        while not (lock.exists() and (extensions / OP / "build.ninja").exists()):
            assert build.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.1)
        time.sleep(2)  # g++ is running now
        assert build.poll() is None
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    assert lock.exists(), "the killed build should have left torch's lock file behind"
    assert not (extensions / OP / f"{OP}.so").exists()


def test_a_training_after_a_build_killed_midway_proceeds(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    _kill_a_build_midway(extensions)

    store = open_store(tmp_path.joinpath("store").as_uri() + "/")
    model = tiny_gpt2(seed=0)
    save_parent(store, "parent", model, tmp_path, tokenizer_size=250)
    rows = pattern_rows(model, 8)
    write_trainset(store, "stage", [rows], tmp_path)
    root = tmp_path.joinpath("store").as_uri()
    where = ["--parent", f"{root}/parent/", "--data", f"{root}/stage/", "--out", f"{root}/out/"]
    train = subprocess.run(
        [console_script("rtrl-job"), "train", *TRAIN, *where],
        env=dict(_env(extensions), RTRL_SCRATCH=str(tmp_path / "scratch")),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert train.returncode == 0, f"{train.stdout[-3000:]}\n{train.stderr[-3000:]}"
    assert "removed a dead build's lock file" in train.stdout
    assert "built deepspeed_shm_comm" in train.stdout
    assert not (extensions / OP / "lock").exists()
    assert (extensions / OP / "rtrl-build.json").exists()


def test_a_live_build_is_waited_for_within_a_bound(tmp_path: Path) -> None:
    """A build lock held by a live process: the wait ends at the bound with an error naming
    the process, instead of never."""
    extensions = tmp_path / "torch_extensions"
    (extensions / OP).mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys,time\n"
         f"fd=os.open({str(extensions / f'.{OP}.rtrl-lock')!r},os.O_RDWR|os.O_CREAT)\n"
         "fcntl.flock(fd,fcntl.LOCK_EX); os.write(fd,str(os.getpid()).encode())\n"
         "print('held',flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "rtrl_trainer.train.cpu_ops"],
            env=dict(_env(extensions), RTRL_OP_BUILD_TIMEOUT="3"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 1
        assert f"waiting for process {holder.pid} building in {extensions}" in out.stderr
        assert f"waited 3s for process {holder.pid} to finish building" in out.stderr
        assert time.monotonic() - started < 60
    finally:
        holder.kill()
        holder.communicate()


def test_a_prebuilt_op_loads_in_place_from_a_read_only_directory(tmp_path: Path) -> None:
    """The trainer image's op (RTRL_PREBUILT_TORCH_EXTENSIONS, built at image build time) is
    imported where it lies, under a read-only root filesystem: nothing is compiled and
    nothing is written."""
    source = Path(sys.prefix) / "torch_extensions" / OP
    prebuilt = tmp_path / "prebuilt"
    (prebuilt / OP).mkdir(parents=True)
    for name in (f"{OP}.so", "rtrl-build.json"):
        (prebuilt / OP / name).write_bytes((source / name).read_bytes())
    for path in (prebuilt / OP, prebuilt):
        path.chmod(0o555)
    extensions = tmp_path / "empty"
    out = subprocess.run(
        [sys.executable, "-m", "rtrl_trainer.train.cpu_ops"],
        env=dict(_env(extensions), RTRL_PREBUILT_TORCH_EXTENSIONS=str(prebuilt), CXX="/bin/false"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(prebuilt / OP / f"{OP}.so") in out.stdout
    assert "building" not in out.stderr
    assert sorted(p.name for p in (prebuilt / OP).iterdir()) == [f"{OP}.so", "rtrl-build.json"]
    assert not extensions.exists() or not any(extensions.rglob("*.so"))
