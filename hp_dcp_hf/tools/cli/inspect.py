"""``hp-dcp-hf inspect PATH [--tensors] [--match REGEX] [--json]``: files, tensors, dtypes, bytes and
index consistency of a checkpoint, from its headers alone (:mod:`hp_dcp_hf.tools.inspection`)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from hp_dcp_hf.tools.cli.arguments import JSON_HELP, PATH_HELP, NewCommand
from hp_dcp_hf.tools.cli.messages import with_messages
from hp_dcp_hf.tools.cli.storage_options import add_storage_option_argument


def add_parser(new_command: NewCommand) -> None:
    parser = new_command("inspect", "files, tensors, dtypes, bytes, index consistency (headers only, no tensor data)")
    parser.add_argument("path", help=PATH_HELP)
    add_storage_option_argument(parser)
    parser.add_argument("--tensors", action="store_true",
                        help="also list every tensor: name, dtype, shape, file, bytes")
    parser.add_argument("--match", type=_regex, default=None, metavar="REGEX",
                        help="list the tensors whose name matches REGEX (re.search; implies --tensors) (default: all)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)
    parser.set_defaults(func=run)


@with_messages
def run(args: argparse.Namespace) -> int:
    from hp_dcp_hf.tools import inspection
    from hp_dcp_hf.tools.formatting import fmt_bytes, table

    info = inspection.inspect_checkpoint(args.path, args.storage_options)
    listed = info.pop("tensor_list")
    if args.match is not None:
        listed = [t for t in listed if args.match.search(t["name"])]
    if args.json:
        print(json.dumps(info | ({"tensor_list": listed} if args.tensors or args.match else {}), indent=2))
        return 0
    print(f"checkpoint {info['path']}")
    if info["config"]:
        print("config     " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
    rows = [(f, d["tensors"], fmt_bytes(d["tensor_bytes"]), fmt_bytes(d["file_bytes"]), d["header_bytes"])
            for f, d in info["files"].items()]
    print(table(("file", "tensors", "tensor bytes", "file size", "header bytes"), rows))
    print("dtypes     " + ", ".join(f"{k}: {v['tensors']} tensors, {fmt_bytes(v['bytes'])}"
                                     for k, v in info["dtypes"].items()))
    print(f"total      {info['tensors']} tensors, {fmt_bytes(info['tensor_bytes'])} ({info['tensor_bytes']} bytes) "
          f"in {len(info['files'])} files")
    quantized = info["quantization"]
    if quantized and "error" in quantized:
        print(f"quantized  {quantized['format']}: NOT READABLE AS VALUES: {quantized['error']}")
    elif quantized:
        print(f"quantized  {quantized['format']}: {quantized['weights']} weights ({fmt_bytes(quantized['weight_bytes'])}) "
              f"with their scales ({fmt_bytes(quantized['scale_bytes'])}); a floating-point model gets their values")
    print(f"index      {_index_line(info)}")
    unfinished = info["unfinished_save"]
    if unfinished:
        print("unfinished a save is running or was interrupted: "
              + ", ".join(f"{i['kind']} {i['name']} ({fmt_bytes(i['bytes'])})" for i in unfinished["items"]))
        print(f"repair     hp-dcp-hf repair {info['path']}: {unfinished['repair']}")
    if listed and (args.tensors or args.match):
        print(table(("tensor", "dtype", "shape", "file", "bytes"),
                    [(t["name"], t["dtype"], str(t["shape"]), t.get("file") or f"{len(t['chunks'])} chunks",
                      fmt_bytes(t["bytes"])) for t in listed]))
    if args.match:
        print(f"{len(listed)} of {info['tensors']} tensors match {args.match.pattern}")
    return 0


def _index_line(info: dict[str, Any]) -> str:
    """What ``inspect`` says of the checkpoint's index: what it lists, or what is read without one."""
    index = info["index"]
    if index["file"]:
        line = f"{index['file']}: {index['keys']} keys in {len(info['files'])} files, consistent with the headers"
        if index["unlisted_files"]:
            line += f"; WARNING: safetensors files the index does not list: {', '.join(index['unlisted_files'])}"
        return line
    if index["single_file"]:
        line = f"none: PATH is one file, {index['single_file']}, and only it is read"
        if index["directory_has_index"]:
            line += (f"; its directory has model.safetensors.index.json: the directory ({info['root']}) is the "
                     "checkpoint, pass it to read every shard")
        return line
    if index["model_safetensors_alone"]:
        return "none: model.safetensors is read, alone (as transformers reads it first)"
    return "none: every .safetensors file of the directory is read"


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {error}") from None
