"""An allow-listed unpickler: checkpoint pickles are data, never code.

``safe_loads(data, allowed)`` runs the C unpickler with ``find_class`` restricted to an explicit
map from ``(module, name)`` to harmless stand-ins defined by ckptool. Anything else — ``os.system``,
``builtins.eval``, ``subprocess.Popen``, even ``torch`` classes we did not list — raises
``UnsafePickleError`` before any object is built, so no code from the file ever runs.
torch is never imported.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

def _data_bytes(kind: type) -> Callable[..., Any]:
    """``bytes``/``bytearray`` taking only the forms pickle writes: ``()``, a bytes object, or
    ``(str, "latin1")``; never a length (``bytearray(10**12)`` would allocate it)."""

    def build(*args: Any) -> Any:
        if not args:
            return kind()
        if len(args) == 1 and type(args[0]) in (bytes, bytearray):
            return kind(args[0])
        if len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
            return kind(args[0].encode("latin1"))
        raise pickle.UnpicklingError(f"{kind.__name__}{args!r:.40} is not a pickled value")

    return build


# Globals a plain-Python payload may use anywhere (all are pure data constructors).
BASIC: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _data_bytes(bytearray),
    ("builtins", "bytes"): _data_bytes(bytes),  # b"" at protocol 2 is bytes()
    ("_codecs", "encode"): lambda s, enc="utf-8": s.encode(enc) if isinstance(s, str) else b"",
}


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        super().__init__(f"{module}.{name}")


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any],
                 persistent_load: Callable[[Any], Any] | None) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol 2 (torch.save's) names builtins the Python 2 way;
            module = "builtins"      # pickle's own find_class maps it the same (fix_imports)
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(module, name) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent ids are not allowed here")
        return self._persistent(pid)


def safe_loads(data: bytes, allowed: Mapping[tuple[str, str], Any], *,
               persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle ``data`` allowing only the globals in ``allowed`` (plus ``BASIC``).

    Raises:
        UnsafePickleError: a global outside the allow-list was named.
        pickle.UnpicklingError, EOFError, ValueError, TypeError, ...: malformed data; callers
            turn every exception into a ``CorruptCheckpointError`` naming the file.
    """
    table = {**BASIC, **allowed}
    return _Unpickler(data, table, persistent_load).load()


class Record:
    """A mutable stand-in for a pickled class: takes NEWOBJ + BUILD like the real one."""

    _positional: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for k, v in zip(self._positional, args):
            setattr(self, k, v)
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __setstate__(self, state: Any) -> None:
        if type(state) is dict:  # the common case, kept fast: 10,000-tensor indexes call this 10^5 times
            self.__dict__.update(state)
            return
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))):
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, tuple) and self._positional:
            state = dict(zip(self._positional, state))
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"bad state for {type(self).__name__}")
        self.__dict__.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)
