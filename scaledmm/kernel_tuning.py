"""Kernel configs as data: the tuned numbers each backend reads.

One JSON file per kernel and architecture it was measured on,
``scaledmm/tuning/kernels/<kernel>_<arch>.json`` (package data)::

    {
      "kernel": "nvfp4_gemv",          # the file name's kernel
      "arch": "sm90",                  # the file name's arch (where it was measured)
      "match": "bucket",               # "bucket" or "max_m" (below)
      "config_fields": ["rows", "warps", "split_k", "unroll"],   # what rows may set
      "rows": [{"n": 6144, "k": 4096, "max_m": 8, "config": {"rows": 16, ...}}, ...],
      "default": [{"max_m": 16, "config": {...}}, ...],   # or null: any shape
      "source": "...", "notes": "..."  # optional free text (provenance)
    }

* ``match: "max_m"``: the rows of one shape (and the ``default`` rows) are
  in strictly ascending ``max_m``; an M takes the first row with
  ``M <= max_m``.
* ``match: "bucket"``: the kernel compiles per M bucket; ``max_m`` is the
  bucket (the backend's ``m_bucket(M)``) and only an equal one matches.
* A shape with no matching row uses the ``default`` rows; with none there
  either, the backend's own rule (code: formulas of N, K and the SM count).
* A row may also carry ``"us"`` (its measured time) and ``"note"`` (text).
* ``config``: keyword arguments of the kernel's config dataclass, every one
  of ``config_fields`` (dataclass fields not listed there keep their defaults).

A file is read at its first lookup (not at import), validated, and each
config built with the dataclass's own constructor (and the backend's
validity check, when it gives one), so a malformed file or an invalid config
raises :class:`TuningError` naming the file and the field at load.
``python -m benchmarks.tune --kernel NAME`` writes these files from a sweep.

This module is part of the core and imports nothing from scaledmm.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import re
import typing
from typing import Any, Callable

__all__ = ["TuningError", "KernelTable", "parse", "load", "LAST_M"]

LAST_M = 2**31 - 1  # a last row with this max_m covers every larger M
MATCHES = ("max_m", "bucket")
_KEYS = {"kernel", "arch", "match", "config_fields", "rows", "default", "source", "notes"}
_ROW_EXTRA = {"us", "note"}  # provenance of a row: its measured time, a remark
_ARCH = re.compile(r"^(cpu|cuda|sm\d+)$")

Rows = tuple[tuple[int, Any], ...]
_KIND = {bool: "true or false", int: "an integer", str: "a string"}


class TuningError(ValueError):
    """A kernel config file that does not follow the format."""


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """The tuned configs of one kernel on one architecture.

    Parameters
    ----------
    kernel, arch : str
        ``"nvfp4_gemv"``, ``"sm90"``.
    match : str
        ``"max_m"`` (first row with ``M <= max_m``) or ``"bucket"`` (equal).
    shapes : mapping
        ``(n, k) -> ((max_m, config), ...)``.
    default : tuple
        ``((max_m, config), ...)`` for any shape without a matching row.
    source : str
        The file the table came from.
    """

    kernel: str
    arch: str
    match: str
    shapes: typing.Mapping[tuple[int, int], Rows]
    default: Rows = ()
    source: str = ""

    def _pick(self, rows: Rows, m: int) -> Any:
        for max_m, cfg in rows:
            if (m == max_m) if self.match == "bucket" else (m <= max_m):
                return cfg
        return None

    def by_shape(self) -> dict[tuple[int, int], dict[int, Any]]:
        """The per-shape rows as ``{(n, k): {max_m: config}}`` (a copy).

        Examples
        --------
        >>> KernelTable("k", "sm90", "bucket", {(64, 128): ((8, "a"),)}).by_shape()
        {(64, 128): {8: 'a'}}
        """
        return {shape: dict(rows) for shape, rows in self.shapes.items()}

    def lookup(self, n: int, k: int, m: int) -> Any:
        """The config for an ``N x K`` weight at ``m`` (the M bucket when
        ``match`` is ``"bucket"``), or None: the backend's rule decides.

        Examples
        --------
        >>> t = KernelTable("k", "sm90", "max_m", {(64, 128): ((16, "a"), (LAST_M, "b"))}, ((8, "c"),))
        >>> t.lookup(64, 128, 3), t.lookup(64, 128, 17), t.lookup(32, 128, 3), t.lookup(32, 128, 9)
        ('a', 'b', 'c', None)
        """
        cfg = self._pick(self.shapes.get((n, k), ()), m)
        return self._pick(self.default, m) if cfg is None else cfg


def _fail(where: str, field: str, expected: str, got: Any) -> typing.NoReturn:
    raise TuningError(f"{where}: {field}: expected {expected}, got {got!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, object) for f in dataclasses.fields(cls) if f.init}


def _config(where: str, field: str, value: Any, cls: type, fields: tuple[str, ...],
            check: Callable[[Any], tuple[bool, str]] | None) -> Any:
    if not isinstance(value, dict):
        _fail(where, field, f"an object of {cls.__name__} fields", value)
    types = _field_types(cls)
    if set(value) != set(fields):
        _fail(where, field, f"exactly the config_fields {list(fields)}", sorted(value))
    for name, v in value.items():
        want = types[name]
        ok = (isinstance(v, bool) if want is bool else _is_int(v) if want is int
              else isinstance(v, str) if want is str else True)
        if not ok:
            _fail(where, f"{field}.{name}", _KIND[want], v)
    try:
        cfg = cls(**value)
    except (TypeError, ValueError) as e:
        raise TuningError(f"{where}: {field}: {cls.__name__}({value}) fails: {e}") from None
    if check is not None:
        good, why = check(cfg)
        if not good:
            _fail(where, field, f"a valid {cls.__name__} ({why})", value)
    return cfg


def _rows(where: str, field: str, rows: Any, cls: type, fields: tuple[str, ...],
          check: Callable[[Any], tuple[bool, str]] | None, shaped: bool) -> dict[tuple[int, int], list]:
    if not isinstance(rows, list):
        _fail(where, field, "a list of rows", rows)
    keys = {"n", "k", "max_m", "config"} if shaped else {"max_m", "config"}
    out: dict[tuple[int, int], list] = {}
    for i, row in enumerate(rows):
        at = f"{field}[{i}]"
        if not isinstance(row, dict) or not keys <= set(row) or set(row) - keys - _ROW_EXTRA:
            _fail(where, at, f"an object with keys {sorted(keys)} (and optionally {sorted(_ROW_EXTRA)})", row)
        if not isinstance(row.get("note", ""), str) or not isinstance(row.get("us", 0.0), (int, float)):
            _fail(where, at, "note a string and us a number", row)
        for key in keys - {"config"}:
            if not _is_int(row[key]) or row[key] <= 0:
                _fail(where, f"{at}.{key}", "a positive integer", row[key])
        shape = (row["n"], row["k"]) if shaped else (0, 0)
        done = out.setdefault(shape, [])
        if done and row["max_m"] <= done[-1][0]:
            _fail(where, f"{at}.max_m", f"more than the previous row's {done[-1][0]} (ascending per shape)",
                  row["max_m"])
        done.append((row["max_m"], _config(where, f"{at}.config", row["config"], cls, fields, check)))
    return out


def parse(data: Any, where: str, cls: type, kernel: str | None = None, arch: str | None = None,
          check: Callable[[Any], tuple[bool, str]] | None = None) -> KernelTable:
    """Validate one kernel config document (``where`` names it in errors),
    building every config as ``cls(**config)`` and passing it to ``check``
    (``(ok, reason)``) when given.

    Examples
    --------
    >>> import dataclasses
    >>> Cfg = dataclasses.make_dataclass("Cfg", [("tile", int)])
    >>> doc = {"kernel": "demo", "arch": "sm90", "match": "max_m", "config_fields": ["tile"],
    ...        "rows": [{"n": 64, "k": 128, "max_m": 16, "config": {"tile": 32}}], "default": None}
    >>> parse(doc, "demo_sm90.json", Cfg).lookup(64, 128, 1)
    Cfg(tile=32)
    >>> doc["rows"][0]["config"] = {"tile": "32"}
    >>> parse(doc, "demo_sm90.json", Cfg)
    Traceback (most recent call last):
    ...
    scaledmm.kernel_tuning.TuningError: demo_sm90.json: rows[0].config.tile: expected an integer, got '32'
    """
    if not isinstance(data, dict):
        _fail(where, "document", "a JSON object", type(data).__name__)
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        _fail(where, "keys", f"only {sorted(_KEYS)}", unknown)
    for key in ("kernel", "arch", "match", "config_fields", "rows"):
        if key not in data:
            _fail(where, key, "a value (required)", None)
    if not isinstance(data["kernel"], str) or (kernel is not None and data["kernel"] != kernel):
        _fail(where, "kernel", repr(kernel) if kernel else "a kernel name", data["kernel"])
    arc = data["arch"]
    if not isinstance(arc, str) or not _ARCH.match(arc) or (arch is not None and arc != arch):
        _fail(where, "arch", repr(arch) if arch else "'cpu', 'cuda' or 'smXY'", arc)
    if data["match"] not in MATCHES:
        _fail(where, "match", f"one of {list(MATCHES)}", data["match"])
    known = list(_field_types(cls))
    fields = data["config_fields"]
    if (not isinstance(fields, list) or not fields or len(set(fields)) != len(fields)
            or not all(f in known for f in fields)):
        _fail(where, "config_fields", f"distinct fields of {cls.__name__} {known}", fields)
    fields = tuple(fields)
    for key in ("source", "notes"):
        if not isinstance(data.get(key, ""), str):
            _fail(where, key, "a string", data[key])
    shapes = _rows(where, "rows", data["rows"], cls, fields, check, shaped=True)
    default = data.get("default")
    base = () if default is None else tuple(
        _rows(where, "default", default, cls, fields, check, shaped=False).get((0, 0), ()))
    return KernelTable(data["kernel"], arc, data["match"], {s: tuple(r) for s, r in shapes.items()}, base, where)


@functools.lru_cache(maxsize=None)
def load(kernel: str, arch: str, cls: type, check: Callable[[Any], tuple[bool, str]] | None = None,
         folder: Any = None) -> KernelTable:
    """The table of ``scaledmm/tuning/kernels/<kernel>_<arch>.json`` (or of
    ``folder``), read once per process and validated (see :func:`parse`).

    Examples
    --------
    >>> from scaledmm.ops.nvfp4_gemv import GemvConfig
    >>> load("nvfp4_gemv", "sm90", GemvConfig).lookup(4096, 4096, 8)
    GemvConfig(rows=16, warps=8, split_k=1, unroll=2)
    """
    shipped = folder is None
    base = importlib.resources.files("scaledmm") / "tuning" / "kernels" if shipped else folder
    name = f"{kernel}_{arch}.json"
    where = f"scaledmm/tuning/kernels/{name}" if shipped else str(base / name)
    entry = base / name
    if not entry.is_file():
        raise TuningError(f"{where}: file: expected a kernel config file, got none")
    try:
        data = json.loads(entry.read_text())
    except json.JSONDecodeError as e:
        raise TuningError(f"{where}: not valid JSON: {e}") from None
    return parse(data, where, cls, kernel, arch, check)
