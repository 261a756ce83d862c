"""The Streamlit demo's parts, one job each; the page itself is `kvrag/demo/app.py`.

- `kvrag.demo.stores`: the demo folder, store URLs (which hosts a store may be on) and the store probe.
- `kvrag.demo.render`: what reaches the page from users and the model: labels, highlighted chunks,
  answers as plain text.
- `kvrag.demo.ingest`: the sample corpus and uploads: size caps, batched precompute with progress.
"""
