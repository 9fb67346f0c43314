"""Health files: each `baton serve ROLE` process rewrites `baton-ROLE-PID.health` in `health.dir`
with its own verdict (baton.serve), and `baton health ROLE` reads them (container health checks).

This module is what `baton health` imports, so it stays light: no NATS client, no aiohttp, no
torch. Under start-up CPU contention a check that imported those took over 10 s.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from baton.shared.config import Config


def health_file(role: str, cfg: Config, pid: int | None = None) -> Path:
    return Path(cfg.health.dir) / f"baton-{role}-{os.getpid() if pid is None else pid}.health"


def remove_stale_health_files(directory: Path, role: str) -> None:
    """Files left by processes of `role` that died without cleaning up (killed, crashed)."""
    for path in directory.glob(f"baton-{role}-*.health"):
        try:
            os.kill(int(path.stem.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, OSError):
            pass


def health_check(role: str, cfg: Config) -> tuple[bool, str]:
    """For `baton health ROLE`: the HTTP frontend is asked over HTTP (/health); other roles are
    healthy when some process of that role on this machine wrote a fresh, good health file."""
    if role == "http":
        import urllib.error
        import urllib.request
        host = "127.0.0.1" if cfg.http.host in ("0.0.0.0", "::", "") else cfg.http.host
        url = f"http://{host}:{cfg.http.port}/health"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return True, f"{url}: {resp.read().decode()}"
        except urllib.error.HTTPError as exc:
            return False, f"{url}: {exc.code} {exc.read().decode(errors='replace')}"
        except OSError as exc:
            return False, f"{url}: {exc}"
    now, reports = time.time(), []
    for path in sorted(Path(cfg.health.dir).glob(f"baton-{role}-*.health")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        age = now - report.get("time", 0)
        if report.get("ok") and age <= cfg.health.max_age_s:
            return True, f"pid {report.get('pid')}: {report.get('detail')} ({age:.0f} s ago)"
        reports.append(f"pid {report.get('pid')}: {report.get('detail')} ({age:.0f} s ago)")
    return False, "; ".join(reports) or f"no health file for {role} in {cfg.health.dir}"
