"""``--storage-option KEY=VALUE``: the options of a checkpoint's store (s3fs, fsspec HTTP, the Hub)
on the command line, so endpoints and credentials need no environment variables."""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_storage_option(text: str) -> tuple[tuple[str, ...], Any]:
    """``KEY=VALUE`` -> ``(key path, value)``: the key split at its dots (``client_kwargs.endpoint_url``
    is ``("client_kwargs", "endpoint_url")``: s3fs and fsspec's HTTP take nested dicts), the value
    parsed as JSON where it is JSON (``true``, ``10``, ``{...}``), else the string itself. A
    ``ValueError`` names what is wrong."""
    key, equals, raw = text.partition("=")
    path = tuple(key.split("."))
    if not equals or not all(path):
        raise ValueError(f"{text!r} is not KEY=VALUE (nested keys with dots: client_kwargs.endpoint_url=URL)")
    try:
        return path, json.loads(raw)
    except json.JSONDecodeError:
        return path, raw


def add_storage_option(options: dict[str, Any], text: str) -> dict[str, Any]:
    """A copy of ``options`` with ``KEY=VALUE`` set (:func:`parse_storage_option`); a later option
    replaces an earlier value, except that objects merge key by key (``headers.A=1`` then
    ``headers={"B": "2"}`` keeps both). A key under a value that is not an object is a ``ValueError``."""
    path, value = parse_storage_option(text)
    out = json.loads(json.dumps(options))  # a deep copy: options are JSON values
    _set_option(out, path, value, text)
    return out


def _set_option(node: dict[str, Any], path: tuple[str, ...], value: Any, text: str) -> None:
    for depth, key in enumerate(path[:-1]):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"{text!r}: {'.'.join(path[:depth + 1])} is {json.dumps(node)} already, not an object")
    leaf = path[-1]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for key, item in value.items():
            _set_option(node[leaf], (key,), item, text)
    else:
        node[leaf] = value


class StorageOptions(argparse.Action):
    """Gathers repeated ``--storage-option KEY=VALUE`` into one dict; a malformed one is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            setattr(namespace, self.dest, add_storage_option(getattr(namespace, self.dest) or {}, values))
        except ValueError as error:
            parser.error(f"argument {option_string}: {error}")


STORAGE_OPTION_HELP = (
    "an option of PATH's store, repeatable: s3fs's (key=, secret=, client_kwargs.endpoint_url=http://..., "
    "client_kwargs.region_name=, anon=true), HTTP's (headers.Authorization='Bearer ...'), the Hub's (token=, "
    "endpoint=); VALUE is JSON where it parses (true, 10, {...}), else a string; dots nest keys (default: none)")


def add_storage_option_argument(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) into ``args.storage_options``."""
    parser.add_argument("--storage-option", action=StorageOptions, dest="storage_options", default={},
                        metavar="KEY=VALUE", help=STORAGE_OPTION_HELP)
