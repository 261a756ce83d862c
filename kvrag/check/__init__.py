"""the per-model correctness gate: checks, noise floor, report."""
