"""One tiny answer before `kvrag serve` reports healthy.

The first forward and decode step of a fresh process pay one-off costs (kernel selection, the
allocator growing, the chat template compiled, lazy imports): a newcomer's first request took about
10x the later ones. The server pays them before it binds its port, so `/health` answering means a
request is answered at full speed. Nothing is kept: plain chat (no chunk KV written), the prefix
cache off.
"""

from __future__ import annotations

import time
from typing import Any


def warm_up(rag: Any) -> float:
    """Run the system prefix and one two-token plain-chat answer through `rag`; returns the seconds it took."""
    t0 = time.perf_counter()
    rag.prefix_kv()  # the system prefix's KV, ready before the first request
    stream = rag.stream_chat([("user", "Hello")], max_new_tokens=2, prefix_cache=False)
    for _ in stream:
        pass
    return time.perf_counter() - t0
