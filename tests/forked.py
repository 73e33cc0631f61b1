"""Many short runs of Python code, each in a process of its own, for the cost of one interpreter start.

``forked_runs`` starts one Python process, runs ``prelude`` there once (imports that every run would
repeat), then forks a child per case: each child sees the prelude's state and nothing of the other
children's, runs ``body`` with ``sys.argv[1:]`` set to its case, and exits as a script would (its
exit status from SystemExit, 1 and a traceback on an uncaught exception). Each child's stdout and
stderr are its own. What comes back is one ``subprocess.CompletedProcess`` per case, in order, as
``subprocess.run`` would have given for a process started for that case alone after the prelude.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# Runs in the forking process: reads its orders from stdin, answers one JSON list on its stdout.
SERVER = r"""
import json, os, sys, tempfile, traceback
orders = json.loads(sys.stdin.read())
answer = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the prelude prints goes to stderr, not into the answer
exec(compile(orders["prelude"], "<prelude>", "exec"), {"__name__": "__prelude__"})
sys.stdout.flush(); sys.stderr.flush()
folder = tempfile.mkdtemp(prefix="forked-")
running, results = {}, [None] * len(orders["cases"])

def child(index, case):
    out = os.open(os.path.join(folder, f"{index}.out"), os.O_WRONLY | os.O_CREAT, 0o600)
    err = os.open(os.path.join(folder, f"{index}.err"), os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(out, 1); os.dup2(err, 2); os.close(out); os.close(err)
    sys.stdin = open(os.devnull)
    sys.argv = [orders["argv0"], *case]
    code = 0
    try:
        exec(compile(orders["body"], "<body>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)

def reap():
    pid, status = os.wait()
    index = running.pop(pid)
    with open(os.path.join(folder, f"{index}.out")) as out, open(os.path.join(folder, f"{index}.err")) as err:
        results[index] = [os.waitstatus_to_exitcode(status), out.read(), err.read()]

for index, case in enumerate(orders["cases"]):
    while len(running) >= orders["parallel"]:
        reap()
    pid = os.fork()
    if pid == 0:
        child(index, case)
    running[pid] = index
while running:
    reap()
answer.write(json.dumps(results))
answer.flush()
"""


def forked_runs(
    prelude: str,
    body: str,
    cases: Sequence[Sequence[str]],
    *,
    argv0: str = "-c",
    python_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    parallel: int = 1,
    timeout: float = 120,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``body`` once per case, each in a child forked after ``prelude`` ran (see the module's
    docstring); ``parallel`` children at most at a time. A prelude that fails is an error here."""
    orders = {"prelude": prelude, "body": body, "cases": [list(c) for c in cases], "argv0": argv0}
    orders["parallel"] = max(1, parallel)
    done = subprocess.run(
        [sys.executable, *python_args, "-c", SERVER],
        input=json.dumps(orders),
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the forking process failed (exit {done.returncode}):\n{done.stderr}")
    return [
        subprocess.CompletedProcess(args=[argv0, *case], returncode=code, stdout=out, stderr=err)
        for case, (code, out, err) in zip(cases, json.loads(done.stdout), strict=True)
    ]
