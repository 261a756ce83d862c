"""chunk KV: the prompt layout, computing it, validating entries, loading and storing them."""
