"""`kvrag store stats|ls|rm|gc`: look into a KV store and tidy it, without loading a model.

Works on `disk://` and `redis://` stores (and `memory://`, which in a fresh process is empty); a
`tiered://` URL is managed through its one persistent tier (disk or Redis). What it reads:

- entries, by their header only (safetensors JSON: `model` fingerprint, `layout`, `kind`,
  `tokens`, dtype, quantisation) -- no tensor is loaded, except by `gc`, which verifies checksums;
- each entry's age: time since it was last written or read (disk: the file's mtime, which a read
  refreshes at most once a minute; Redis: `OBJECT IDLETIME`);
- the node-id index (`"<namespace>/<id>" -> key`, namespace = content_key(fingerprint, layout)[:16]);
- temp files of writers (disk) and split-entry parts no manifest names (Redis).

The functions (`store_stats`, `list_entries`, `remove`, `gc`) return plain dicts, which the CLI
prints as text or, with `--json`, as JSON; the command itself is `kvrag.cli.store`.
"""

from kvrag.cache_backends.admin.base import EntryInfo, StoreAdmin, namespace_of
from kvrag.cache_backends.admin.opening import open_admin
from kvrag.cache_backends.admin.operations import gc, list_entries, remove, store_stats

__all__ = ["EntryInfo", "StoreAdmin", "gc", "list_entries", "namespace_of", "open_admin",
           "remove", "store_stats"]
