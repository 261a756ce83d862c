"""The fault soak's faults (scripts/fault_soak.py): a loopback redis-server it owns, and the schedule
that kills, freezes, squeezes and flushes it while the soak's threads answer."""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any


log = logging.getLogger("fault_soak")


# -- redis-server, started and abused here --------------------------------------------------------
def wait_for_port(port: int, seconds: float, what: str) -> None:
    """Return once something accepts connections on 127.0.0.1:`port`; RuntimeError after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{what} did not start on port {port}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A redis-server on loopback that the fault schedule kills, restarts empty, freezes and squeezes."""

    def __init__(self, binary: str | None = None, port: int | None = None) -> None:
        self.binary = binary or shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.frozen = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, 10, "redis-server")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.frozen:
                self.cont()
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop_signal(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def cont(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def admin(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=5)

    def used_memory(self) -> int | None:
        try:
            return int(self.admin().info("memory")["used_memory"])
        except Exception:
            return None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.frozen:
                self.cont()
            self.proc.kill()
            self.proc.wait()


# -- the fault schedule ---------------------------------------------------------------------------
FAULT_KINDS = ("kill_restart", "freeze", "maxmemory_noeviction", "maxmemory_allkeys_lru", "flushall")


@dataclass
class Fault:
    kind: str
    start: float  # seconds since the soak started
    end: float = 0.0
    detail: str = ""
    error: str = ""


@dataclass
class FaultPlan:
    every: float = 15.0  # seconds between two fault starts
    first: float = 8.0  # quiet seconds before the first fault
    down_s: float = 2.0  # how long the killed server stays down before its empty restart
    freeze_s: float = 3.0  # SIGSTOP .. SIGCONT
    squeeze_s: float = 10.0  # maxmemory tiny for this long
    maxmemory: str = "2mb"

    def schedule(self, seconds: float) -> list[tuple[float, str]]:
        """(start, kind) pairs cycling through the kinds; each ends (nominally) 1 s before the soak does."""
        lengths = {"kill_restart": self.down_s, "freeze": self.freeze_s, "maxmemory_noeviction": self.squeeze_s,
                   "maxmemory_allkeys_lru": self.squeeze_s, "flushall": 0.0}  # fmt: skip
        out, t, i = [], self.first, 0
        while True:
            kind = FAULT_KINDS[i % len(FAULT_KINDS)]
            if t + lengths[kind] > seconds - 1.0:
                break
            out.append((t, kind))
            t += max(self.every, lengths[kind] + 1.0)
            i += 1
        return out


class FaultDriver(threading.Thread):
    def __init__(self, server: RedisProcess, plan: FaultPlan, seconds: float, t0: float, stop: threading.Event) -> None:
        super().__init__(name="faults", daemon=True)
        self.server, self.plan, self.seconds, self.t0, self.stop_event = server, plan, seconds, t0, stop
        self.faults: list[Fault] = []
        self.lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def wait_until(self, t: float) -> bool:
        """Sleep until soak time t; False when the soak was stopped first."""
        return not self.stop_event.wait(max(0.0, t - self.now()))

    def run(self) -> None:
        for start, kind in self.plan.schedule(self.seconds):
            if not self.wait_until(start):
                return
            fault = Fault(kind, round(self.now(), 3))
            with self.lock:
                self.faults.append(fault)
            try:
                getattr(self, kind)(fault)
            except Exception as exc:  # the driver's own failure is reported, never hidden
                fault.error = f"{type(exc).__name__}: {exc}"
                log.error("fault %s failed: %s", kind, fault.error)
            fault.end = round(self.now(), 3)
            log.info("fault %-22s %6.2f .. %6.2f s %s", kind, fault.start, fault.end, fault.detail)

    def kill_restart(self, fault: Fault) -> None:
        self.server.kill9()
        self.stop_event.wait(self.plan.down_s)
        self.server.start()
        fault.detail = f"SIGKILL, down {self.plan.down_s:g} s, restarted empty on the same port"

    def freeze(self, fault: Fault) -> None:
        self.server.stop_signal()
        try:
            self.stop_event.wait(self.plan.freeze_s)
        finally:
            self.server.cont()
        fault.detail = f"SIGSTOP for {self.plan.freeze_s:g} s, then SIGCONT"

    def _squeeze(self, fault: Fault, policy: str) -> None:
        """Lose a random half of the keys (manifests, parts, maybe the index), fill the server with
        filler up to the tiny maxmemory, then set it: the writes that follow misses are refused
        (noeviction) or evict other keys (allkeys-lru)."""
        admin = self.server.admin()
        limit = _bytes(self.plan.maxmemory)
        keys = admin.keys("kvrag:*")
        dropped = random.Random(int(fault.start * 1000)).sample(keys, len(keys) // 2)
        if dropped:
            admin.delete(*dropped)
        filler = 0
        while (self.server.used_memory() or limit) < limit and filler < 4096:
            admin.set(f"soak:filler:{filler}", os.urandom(32 << 10))
            filler += 1
        before = self.server.used_memory()
        admin.config_set("maxmemory-policy", policy)
        admin.config_set("maxmemory", str(limit))
        try:
            self.stop_event.wait(self.plan.squeeze_s)
            during = self.server.used_memory()
            left = admin.dbsize()
        finally:
            admin.config_set("maxmemory", "0")
            admin.config_set("maxmemory-policy", "noeviction")
        admin.delete(*admin.keys("soak:filler:*") or ["soak:filler:none"])
        fault.detail = (f"dropped {len(dropped)} of {len(keys)} kvrag keys, {filler} x 32 KB filler, then maxmemory "
                        f"{self.plan.maxmemory} {policy} for {self.plan.squeeze_s:g} s; used_memory {_mb(before)} "
                        f"at the start, {_mb(during)} at the end, {left} keys at the end")  # fmt: skip

    def maxmemory_noeviction(self, fault: Fault) -> None:
        self._squeeze(fault, "noeviction")

    def maxmemory_allkeys_lru(self, fault: Fault) -> None:
        self._squeeze(fault, "allkeys-lru")

    def flushall(self, fault: Fault) -> None:
        admin = self.server.admin()
        keys = admin.dbsize()
        admin.flushall()
        fault.detail = f"FLUSHALL ({keys} keys dropped)"


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(b|kb|mb|gb)?", size.strip().lower())
    if not m:
        raise ValueError(f"maxmemory must look like 2mb, 512kb or 1048576, got {size!r}")
    return int(m.group(1)) * {None: 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}[m.group(2)]


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f} MB"
