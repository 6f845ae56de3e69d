"""Which lease holders are known to be gone: only processes of this machine and pid namespace that no longer run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from agentmem.leases import holder_state, process_owner


def owner_with(pid: int, *, host: str | None = None) -> str:
    name, _, machine, nonce = process_owner().split(":")
    return f"{host or name}:{pid}:{machine}:{nonce}"


def test_this_process_runs_and_an_exited_one_is_gone():
    assert holder_state(process_owner()) == "running"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert holder_state(owner_with(child.pid)) == "gone"


def test_a_killed_child_not_yet_reaped_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder_state(owner_with(child.pid)) == "running"
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, still a zombie
        assert holder_state(owner_with(child.pid)) == "gone"
    finally:
        child.kill()
        child.wait()


def test_holders_elsewhere_or_of_another_form_cannot_be_judged():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert holder_state(owner_with(child.pid, host="another-host")) == "unknown"  # a snapshot-restored twin
    name, pid, _, nonce = owner_with(child.pid).split(":")
    assert holder_state(f"{name}:{pid}:{'0' * 16}:{nonce}") == "unknown"  # another boot or pid namespace
    assert holder_state("worker-a") == "unknown"
