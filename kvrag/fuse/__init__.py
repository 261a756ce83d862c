"""re-rotating and stitching chunk KV, probes, link tokens: the shared recompute pass."""
