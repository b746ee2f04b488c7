"""``--storage-option KEY=VALUE``: how values and dotted keys parse, and an S3 checkpoint inspected,
planned, loaded, saved back and repaired against moto's S3 server with every store setting on the
command line (no ``AWS_*`` variable in the environment)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load, load_file

from hp_dcp_hf.tools.cli import main
from hp_dcp_hf.tools.cli.storage_options import add_storage_option, parse_storage_option
from tests.support.models import DEFAULT_SHARD_SIZE, checkpoint_keys
from tests.support.servers.s3 import CREDENTIALS, REGION, MotoS3

BUCKET = "cli-options"


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, path, value", [
    ("anon=true", ("anon",), True),
    ("config_kwargs.read_timeout=60", ("config_kwargs", "read_timeout"), 60),
    ("client_kwargs.endpoint_url=http://127.0.0.1:9000", ("client_kwargs", "endpoint_url"), "http://127.0.0.1:9000"),
    ("headers.Authorization=Bearer x=y", ("headers", "Authorization"), "Bearer x=y"),  # the first = splits
    ('token="123"', ("token",), "123"),  # a JSON string: digits kept as text
    ("token=123", ("token",), 123),
    ("key=", ("key",), ""),
    ('client_kwargs={"region_name": "us-east-1"}', ("client_kwargs",), {"region_name": "us-east-1"}),
])
def test_a_value_is_json_where_it_parses_else_a_string(text, path, value):
    assert parse_storage_option(text) == (path, value)


def test_dotted_keys_nest_and_objects_merge():
    options: dict = {}
    for text in ("key=k", "client_kwargs.endpoint_url=http://s3", 'client_kwargs={"region_name": "eu"}',
                 "config_kwargs.s3.addressing_style=path", "key=other"):
        before = json.dumps(options)
        options = add_storage_option(options, text)
        assert json.dumps(json.loads(before)) == before  # the earlier dict is left as it was
    assert options == {"key": "other", "client_kwargs": {"endpoint_url": "http://s3", "region_name": "eu"},
                       "config_kwargs": {"s3": {"addressing_style": "path"}}}
    with pytest.raises(ValueError, match=r"'key.sub=1': key is \"other\" already, not an object"):
        add_storage_option(options, "key.sub=1")


@pytest.mark.parametrize("bad", ["endpoint", "=x", "a..b=1", ".a=1"])
def test_a_malformed_option_is_a_one_line_usage_error(capsys, bad):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", "somewhere", "--storage-option", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"hp-dcp-hf: error: argument --storage-option: {bad!r} is not KEY=VALUE"), err


# -- S3 through the command line ------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory, tiny_checkpoints):
    server = MotoS3(tmp_path_factory.mktemp("moto") / "recording.jsonl")
    try:
        server.create_bucket(BUCKET)
        server.upload_dir(tiny_checkpoints("llama", torch.bfloat16).path, BUCKET, "llama")
        yield server
    finally:
        server.stop()


def test_s3_by_storage_options_alone(capsys, s3, tiny_checkpoints, monkeypatch):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    local = tiny_checkpoints("llama", torch.bfloat16).path
    options = [f"--storage-option=key={CREDENTIALS['key']}", f"--storage-option=secret={CREDENTIALS['secret']}",
               f"--storage-option=client_kwargs.endpoint_url={s3.url}",
               f"--storage-option=client_kwargs.region_name={REGION}"]
    source, saved = f"s3://{BUCKET}/llama", f"s3://{BUCKET}/saved"

    assert main(["inspect", source, *options, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == len(checkpoint_keys(local))
    assert main(["plan", source, "--mesh", "dp=1", *options, "--json"]) == 0
    (planned,) = json.loads(capsys.readouterr().out)["ranks"]
    s3.start_recording()
    assert main(["load", source, *options, "--save-to", saved, "--max-shard-size", DEFAULT_SHARD_SIZE, "--json"]) == 0
    s3.stop_recording()
    (row,) = json.loads(capsys.readouterr().out)["ranks"]
    assert row["bytes_read"] == planned["bytes_to_read"] > 0 and not row["mapped"]
    assert any(r.range for r in s3.recording() if r.method == "GET")  # the data came from the server
    listed = s3.client.list_objects_v2(Bucket=BUCKET, Prefix="saved/")["Contents"]
    ours = {o["Key"].removeprefix("saved/"): s3.client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
            for o in listed}
    assert sorted(ours) == sorted(p.name for p in local.iterdir())  # the destination took --storage-option too
    for file in local.glob("*.safetensors"):
        expected, got = load_file(file), load(ours[file.name])
        assert sorted(got) == sorted(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    assert main(["repair", saved, *options]) == 0
    assert capsys.readouterr().out == f"{saved}: nothing to repair\n"
