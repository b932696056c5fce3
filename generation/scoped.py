"""A context variable set inside a ``with`` block: the base of :class:`dspark.generation.integration.dspark_options` and
:class:`dspark.generation.stats.collect_stats`."""

from __future__ import annotations

import contextvars
import warnings

__all__ = ["ScopedValue"]


class ScopedValue:
    """Sets a context variable to ``value`` inside a ``with`` block (this thread / task only) and restores it after;
    ``as`` gives ``value``. Nothing happens outside a ``with``, so an object discarded without ever being entered
    warns (``UserWarning``: "NAME was created but never entered, so it EFFECT; use it as `USAGE`")."""

    def __init__(self, var: contextvars.ContextVar, value, name: str, effect: str, usage: str):
        self._var, self._value = var, value
        self._why_unused = f"{name} was created but never entered, so it {effect}; use it as `{usage}`"
        self._tokens: list[contextvars.Token] = []
        self._entered = False

    def __enter__(self):
        self._entered = True
        self._tokens.append(self._var.set(self._value))
        return self._value

    def __exit__(self, *exc) -> None:
        self._var.reset(self._tokens.pop())

    def __del__(self):
        if not getattr(self, "_entered", True):
            warnings.warn(self._why_unused, UserWarning, stacklevel=2)
