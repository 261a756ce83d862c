"""Fault soak over Redis Cluster (issue #35): threads answer while one of three masters is killed.

    python scripts/cluster_soak.py --seconds 60 --threads 4 --out cluster-soak [--model tiny|bundled]

It starts its own 3-master cluster on loopback ports (tests/redis_cluster.py: `redis-server
--cluster-enabled yes`, `redis-cli --cluster create`), precomputes the fault soak's corpus into it
(scripts/fault_soak.py: the same questions, methods and addressing by text and by id), answers every
item once for the reference, then runs `--threads` threads for `--seconds` and kills one master (kill
-9, no replica) a third of the way in. Every answer must equal the reference (what the dead shard
held is a miss and is computed again), none may raise, and every entry that lived on the other two
shards must still be there. Writes OUT/cluster_soak.json and OUT/cluster_soak.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_soak import build_engine, corpus, hardware, reference_pass, soak_threads, work_items  # noqa: E402
from redis_cluster import RedisClusterProcess  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--out", default="cluster-soak")
    p.add_argument("--model", choices=["tiny", "bundled"], default="tiny")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = RedisClusterProcess().start()
    try:
        url = cluster.url + "?socket_timeout=0.5&connect_timeout=0.5&part_bytes=16384"
        rag = build_engine(args.model, url)
        chunks = corpus(20)
        by_id = {c.id: c for c in chunks}
        items = work_items(chunks)
        rag.precompute(chunks, progress=False)
        keys = rag._resolve(chunks).keys
        owner = {k: rag.store.client.get_node_from_key(rag.store._name(k)).port for k in keys}
        reference = [r[0] for r in reference_pass(rag, items, by_id)]
        victim = cluster.ports[1]
        t0 = time.monotonic()
        stop = threading.Event()

        def kill_later() -> None:
            if not stop.wait(args.seconds / 3):
                cluster.kill(victim)

        killer = threading.Thread(target=kill_later, daemon=True)
        killer.start()
        records, errors = soak_threads(rag, items, by_id, reference, args.threads, args.seconds, t0, stop)
        stop.set()
        killed_at = args.seconds / 3
        import redis

        elsewhere = [k for k in keys if owner[k] != victim]  # asked of the shard that holds each, directly
        lost = [k for k in elsewhere if not redis.Redis(port=owner[k]).exists(rag.store._name(k))]
    finally:
        cluster.stop()
    after = [r for r in records if r.start >= killed_at]
    summary = {
        "answers": len(records), "identical": sum(r.identical for r in records), "different": sum(not r.identical for r in records),
        "exceptions": len(errors), "answers_after_the_kill": len(after), "misses_after_the_kill": sum(r.misses for r in after),
        "entries": len(keys), "entries_on_the_killed_shard": len(keys) - len(elsewhere), "entries_lost_elsewhere": len(lost),
    }
    result = {"command": f"python scripts/cluster_soak.py --seconds {args.seconds:g} --threads {args.threads} --model {args.model}",
              "hardware": hardware(), "killed_port": victim, "killed_at_s": killed_at, "summary": summary,
              "errors": errors[:20], "differences": [r.__dict__ for r in records if not r.identical][:20]}
    (out / "cluster_soak.json").write_text(json.dumps(result, indent=1))
    rows = "\n".join(f"| {k.replace('_', ' ')} | {v} |" for k, v in summary.items())
    md = (f"# Fault soak over Redis Cluster\n\n`{result['command']}` — {result['hardware']}\n\n"
          f"3 masters, no replicas; one killed (kill -9) at {killed_at:g} s of {args.seconds:g} s.\n\n| | |\n|---|---|\n{rows}\n")
    (out / "cluster_soak.md").write_text(md)
    print(md)
    ok = summary["different"] == 0 and summary["exceptions"] == 0 and summary["entries_lost_elsewhere"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
