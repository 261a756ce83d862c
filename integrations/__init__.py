"""Framework integrations: `kvrag.integrations.llama_index` and `kvrag.integrations.langchain`."""
