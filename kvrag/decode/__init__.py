"""the token loop after the prefill, and its static-buffer variant."""
