"""The methods' own parameters (`kvrag.params`), checked before a request queues or runs.

The engine reads a method's parameters only when it selects tokens, and some only with enough
context to select from (`layer` of a one-chunk answer is never read), so a bad value could answer 200
or fail deep in a pass with a raw Python message. Here each parameter a shipped method takes is
checked by name, on the raw JSON value, against the served model (its layer count, its link adapter):
a clean 400 naming the parameter, before any work. Names no shipped method uses are left to the
method's constructor, which names the parameters it takes. A null value means the method's default
(`answer_options` drops it), so none is checked here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from kvrag.server.errors import APIError

MAX_LINK_TOKENS = 16  # kvlink without a trained adapter: untrained link rows, one table per K kept by the engine


def _bad(name: str, message: str) -> APIError:
    return APIError(400, f"kvrag.params.{name}: {message}", "invalid_method", param=f"kvrag.params.{name}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v: Any, lo: int, hi: int | None = None, what: str = "") -> None:
    if not _is_int(v):
        raise _bad(name, f"must be an integer{what}, got {v!r}"[:200])
    if v < lo or (hi is not None and v > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise _bad(name, f"must be {bound}{what}, got {v}")


def _layer(name: str, v: Any, n_layers: int | None) -> None:
    if n_layers is None:
        _int(name, v, -(10**6), 10**6)
        return
    _int(name, v, -n_layers, n_layers - 1, f" (a layer of this {n_layers}-layer model; negative counts from the last)")


def _bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise _bad(name, f"must be true or false, got {v!r}"[:200])


def _choice(*allowed: str) -> Callable[[str, Any, "Model"], None]:
    def check(name: str, v: Any, model: "Model") -> None:
        if v not in allowed:
            raise _bad(name, f"must be one of {', '.join(map(repr, allowed))}, got {v!r}"[:200])

    return check


class Model:
    """What the checks need to know about the served model."""

    def __init__(self, n_layers: int | None = None, adapter_link_tokens: int | None = None) -> None:
        self.n_layers, self.adapter_link_tokens = n_layers, adapter_link_tokens


def _check_layer(name: str, v: Any, model: Model) -> None:
    _layer(name, v, model.n_layers)


def _check_stable_layers(name: str, v: Any, model: Model) -> None:
    if not isinstance(v, list) or not v:
        raise _bad(name, f"must be a non-empty list of layers, got {v!r}"[:200])
    for i, layer in enumerate(v):
        _layer(f"{name}[{i}]", layer, model.n_layers)


def _check_block_size(name: str, v: Any, model: Model) -> None:
    if v != "auto":
        _int(name, v, 1, None, ' (tokens per block) or "auto"')


def _check_link_tokens(name: str, v: Any, model: Model) -> None:
    if model.adapter_link_tokens is not None:
        _int(name, v, 0, None)
        if v not in (0, model.adapter_link_tokens):
            raise _bad(name, f"the link adapter of this server was trained with {model.adapter_link_tokens} link tokens; pass that (or 0), got {v}")
        return
    _int(name, v, 0, MAX_LINK_TOKENS, " (no link adapter is loaded: the link rows are untrained)")


def _check_start(name: str, v: Any, model: Model) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 1 or v > 1e6:
        raise _bad(name, f"must be a number from 1 to 1000000, got {v!r}"[:200])


def _check_select(name: str, v: Any, model: Model) -> None:
    if not isinstance(v, str) or not v:
        raise _bad(name, f"must be a method name, got {v!r}"[:200])


CHECKS: Mapping[str, Callable[[str, Any, Model], None]] = {
    "layer": _check_layer,  # a3, fusionrag, cacheblend
    "stable_layers": _check_stable_layers,  # samkv
    "block_size": _check_block_size,  # samkv
    "initial_blocks": lambda n, v, m: _int(n, v, 0, 10**6),  # samkv
    "local_blocks": lambda n, v, m: _int(n, v, 0, 10**6),  # samkv
    "update": _choice("overwrite", "fusion"),  # samkv
    "sparsify": lambda n, v, m: _bool(n, v),  # samkv
    "deviation": _choice("value", "key"),  # cacheblend
    "gradual": lambda n, v, m: _bool(n, v),  # cacheblend
    "start": _check_start,  # cacheblend
    "steps": lambda n, v, m: _int(n, v, 1, m.n_layers or 64, " (one probe pass per step, at most one per layer)"),  # cacheblend
    "link_tokens": _check_link_tokens,  # kvlink
    "select": _check_select,  # kvlink: its selection rule (the rule's own parameters are checked by name too)
}


def check_method_params(params: Mapping[str, Any], model: Model) -> None:
    """A 400 for the first parameter whose value no method could use on this model."""
    for name, value in params.items():
        check = CHECKS.get(name)
        if check is not None:
            check(name, value, model)
