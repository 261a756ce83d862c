"""Which stored KV an entry is: a kind is part of every key, so a request names the kind it reads."""

KIND_CHUNK = "chunk"  # a chunk's KV computed after the system prefix alone
KIND_SIMILARITY = "similarity"  # ... after the prefix and its most similar chunks (FusionRAG §3.1)
KIND_PREFIX = "prefix"
CHUNK_KINDS = (KIND_CHUNK, KIND_SIMILARITY)
