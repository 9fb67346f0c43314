"""baton/launcher.py: services forked from one process that imported them, each as its own
process would be (log, environment, session, title, exit status), and none outliving the launcher."""
import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from baton.launcher import Launcher
from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.internal import LookupReply, LookupRequest
from baton.shared.bus import Bus
from baton.shared.config import env_name
from baton.shared.process import child_env
from e2e_cluster import until_sync
from test_up_supervision import alive

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def launcher():
    launcher = Launcher(child_env(dict(os.environ)))
    yield launcher
    launcher.close()


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()


def registry_answers(url: str) -> bool:
    async def ask() -> bool:
        async with await Bus.connect(url, "test") as bus:
            try:
                await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply, timeout=1.0)
                return True
            except BatonError:
                return False
    return asyncio.run(ask())


def test_a_command_runs_with_its_own_environment_and_log_and_its_exit_code_comes_back(launcher, tmp_path):
    log = tmp_path / "config.log"
    env = {**os.environ, env_name("worker.num_pages"): "77"}
    done = launcher.spawn(["config", "show"], env, log)
    assert done.wait(120) == 0
    assert "num_pages = 77  # KV pages per worker [env BATON_WORKER_NUM_PAGES;" in log.read_text()
    refused = launcher.spawn(["config", "show", "--no-such-flag"], dict(os.environ), log, append=True)
    assert refused.wait(60) == 2  # argparse's SystemExit(2), as `python -m baton` would exit
    text = log.read_text()
    assert "num_pages = 77" in text and "unrecognized arguments: --no-such-flag" in text  # appended


def test_a_service_is_titled_its_own_session_and_answers_signals_as_a_process(launcher, tmp_path, nats_server):
    registry = launcher.spawn(["serve", "registry", "--nats-url", nats_server], dict(os.environ), tmp_path / "r.log")
    until_sync(lambda: registry_answers(nats_server), 120, "the registry answers")
    assert cmdline(registry.pid).endswith(f"-m baton serve registry --nats-url {nats_server}")
    assert os.getsid(registry.pid) == registry.pid != os.getsid(0)
    assert registry.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        registry.wait(0.1)
    registry.send_signal(signal.SIGTERM)
    assert registry.wait(60) == 0  # its own graceful stop
    assert "registry stopped" in (tmp_path / "r.log").read_text()
    registry.kill()  # reaped already: nothing is signalled
    assert registry.returncode == 0


def test_what_runs_when_the_launcher_closes_or_dies_is_killed_with_it(tmp_path, nats_server):
    for end in ("close", "kill"):
        launcher = Launcher(child_env(dict(os.environ)))
        service = launcher.spawn(["serve", "registry", "--nats-url", nats_server], dict(os.environ),
                                 tmp_path / f"{end}.log")
        until_sync(lambda: registry_answers(nats_server), 120, "the registry answers")
        if end == "close":
            launcher.close()
        else:
            launcher._proc.kill()  # as the kernel kills it when its client dies (PR_SET_PDEATHSIG)
        assert service.wait(30) == -signal.SIGKILL
        until_sync(lambda: not alive(service.pid), 30, f"the registry gone after the launcher's {end}", every_s=0.05)
        if end == "kill":
            launcher.close()
