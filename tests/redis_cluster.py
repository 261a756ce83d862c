"""A real local Redis Cluster for tests: N masters on loopback ports, joined with `redis-cli --cluster create`."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from test_backends import REDIS

REDIS_CLI = shutil.which("redis-cli")
CLUSTER_OK = REDIS is not None and REDIS_CLI is not None


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too (ephemeral ports can exceed it)."""
    while True:
        port = random.randint(20000, 30000)
        if _free(port) and _free(port + 10000):
            return port


class RedisClusterProcess:
    """`masters` redis-server processes with cluster mode on, no persistence, slots spread over all."""

    def __init__(self, masters: int = 3) -> None:
        self.ports = [_cluster_port() for _ in range(masters)]
        self.dir = Path(tempfile.mkdtemp(prefix="kvrag-cluster-"))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + "/"

    def _start_one(self, port: int) -> None:
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(node_dir / "nodes.conf"), "--cluster-node-timeout", "2000",
             "--cluster-require-full-coverage", "no",  # a cache: the other shards keep serving when one is gone
             "--save", "", "--appendonly", "no", "--dir", str(node_dir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def _ping(self, port: int) -> bool:
        out = subprocess.run([REDIS_CLI, "-p", str(port), "ping"], capture_output=True, text=True)
        return out.stdout.strip() == "PONG"

    def start(self) -> "RedisClusterProcess":
        for port in self.ports:
            self._start_one(port)
        deadline = time.time() + 20
        while not all(self._ping(p) for p in self.ports):
            if time.time() > deadline:
                raise RuntimeError("redis cluster nodes did not start")
            time.sleep(0.1)
        subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        while "cluster_state:ok" not in subprocess.run([REDIS_CLI, "-p", str(self.ports[0]), "cluster", "info"],
                                                       capture_output=True, text=True).stdout:
            if time.time() > deadline + 20:
                raise RuntimeError("redis cluster did not become ok")
            time.sleep(0.1)
        return self

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def keys_on(self, port: int) -> int:
        out = subprocess.run([REDIS_CLI, "-p", str(port), "dbsize"], capture_output=True, text=True)
        return int(out.stdout.strip() or 0)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)
