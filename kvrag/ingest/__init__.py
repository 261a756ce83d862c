"""files -> chunks -> vector index: reading documents, splitting, retrieval."""
