"""`kvrag serve`: one warm process holding the model and the KV store, which every client talks to
over HTTP (OpenAI-compatible chat, chunk ingest/delete, health, Prometheus metrics).

Needs the `server` extra: `pip install "kvrag[server]"`.
"""

from kvrag.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]


def __getattr__(name: str):  # the app pulls FastAPI in; the settings and the CLI parser do not
    if name == "create_app":
        from kvrag.server.app import create_app

        return create_app
    if name == "serve":
        from kvrag.server.runner import serve

        return serve
    raise AttributeError(name)
