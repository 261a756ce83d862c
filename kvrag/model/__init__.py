"""the Hugging Face model and its hooks: loading, shapes, attention, RoPE, masks, every Cache subclass."""
