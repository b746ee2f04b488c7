"""Process groups are made once per process: repeated loads and saves leave no threads behind.

On 2 gloo ranks, a process calls ``from_pretrained(..., distributed_config="dp=1,tp=2")`` ten
times, then ``save_hf_checkpoint`` ten times, then ten cooperative loads (``cooperate="always"``)
into the model: the OS thread count of each rank (``/proc/self/task``, gloo's threads included)
after the tenth call of each is the count after the first; before the groups were reused, every
``from_pretrained`` added 18. The tenth model holds exactly the first's values.
:func:`~hp_dcp_hf.parallel.init_mesh` answers the same spec with the same mesh, and a new one
once the default group was destroyed and made again.

With the caller's mesh (``from_pretrained(..., device_mesh=mesh)``, a 2-D ``("dp", "tp")`` mesh
from ``init_device_mesh``) the package makes no group at all: ten calls leave the thread count the
mesh left, the parameters are DTensors on the caller's groups, and their local shards and
placements are those of transformers' own ``from_pretrained(distributed_config=...)`` on a mesh of
the same shape, their values those of its single-process load. A 1-D mesh without names is the
tensor parallel mesh, a named 1-D ``("dp",)`` one FSDP's; one that does not fit the
``distributed_config`` is a ``MeshSpecError`` before anything is read.
"""

from __future__ import annotations

import os
import time

import torch
from torch.distributed.tensor import DTensor

from hp_dcp_hf.tools.launch import free_port, run_ranks
from tests.support.models import load_reference

CALLS = 10


def _threads() -> int:
    """This process's OS threads, once no thread is still exiting (two equal reads 50 ms apart)."""
    count = len(os.listdir("/proc/self/task"))
    for _ in range(40):
        time.sleep(0.05)
        count, before = len(os.listdir("/proc/self/task")), count
        if count == before:
            break
    return count


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() for k, v in model.state_dict().items()}


def _repeat(rank: int, world: int, path: str, out: str) -> dict:
    from hp_dcp_hf import HFStorageReader, load_hf_checkpoint, save_hf_checkpoint
    from hp_dcp_hf.integrations.transformers import from_pretrained

    counts: dict[str, list[int]] = {"start": [_threads()], "from_pretrained": [], "save": [], "cooperative": []}
    states = []
    for _ in range(CALLS):
        model, _ = from_pretrained(path, dtype=torch.float32, distributed_config="dp=1,tp=2")
        counts["from_pretrained"].append(_threads())
        if not states:
            states.append(_full(model))
    states.append(_full(model))
    for _ in range(CALLS):
        save_hf_checkpoint(model, out)
        counts["save"].append(_threads())
    cooperating = []
    for _ in range(CALLS):
        reader = HFStorageReader(path, cooperate="always", span_bytes=4096)
        load_hf_checkpoint(model, path, reader=reader)
        cooperating.append(reader.cooperating)
        counts["cooperative"].append(_threads())
    states.append(_full(model))
    first, *later = states
    return {"counts": counts, "cooperating": cooperating,
            "same": all(torch.equal(first[k], s[k]) for s in later for k in first)}


def test_repeated_calls_leave_no_threads(llama_checkpoint, tmp_path):
    results = run_ranks(2, _repeat, str(llama_checkpoint.path), str(tmp_path / "saved"), timeout=300)
    for rank, result in enumerate(results):
        counts = result["counts"]
        print(f"rank {rank}: threads " + ", ".join(f"{k} {v[0]} -> {v[-1]}" for k, v in counts.items()))
        for kind in ("from_pretrained", "save", "cooperative"):
            assert counts[kind] == [counts["from_pretrained"][0]] * CALLS, (rank, kind, counts[kind])
        assert result["cooperating"] == [True] * CALLS
        assert result["same"]


def _meshes(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    from hp_dcp_hf.parallel import init_mesh

    first = init_mesh("dp=1,tp=2")
    again = init_mesh("tp=2,dp=1")
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    after = init_mesh("dp=1,tp=2")
    total = torch.tensor([rank + 1])
    dist.all_reduce(total, group=after.get_group("tp"))  # the new mesh's groups work
    return {"same": again is first, "dims": first.mesh_dim_names, "renewed": after is not first,
            "total": int(total)}


def test_init_mesh_reused_until_the_default_group_changes():
    for result in run_ranks(2, _meshes, free_port()):
        assert result == {"same": True, "dims": ("dp", "tp"), "renewed": True, "total": 3}


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    """Each tensor's local shard, placements and mesh shape (plain tensors: the tensor)."""
    return {k: (v.to_local(), tuple(map(str, v.placements)), tuple(v.device_mesh.shape)) if isinstance(v, DTensor)
            else (v.detach().clone(), (), ()) for k, v in model.state_dict().items()}


def _same_layout(got: dict[str, tuple], want: dict[str, tuple]) -> list[str]:
    """Keys whose shard, placements or mesh shape differ (both sides hold the same keys)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return sorted(k for k in want if got[k][1:] != want[k][1:] or not torch.equal(got[k][0], want[k][0]))


def _caller_mesh(rank: int, world: int, path: str) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import DistributedConfig, LlamaForCausalLM

    from hp_dcp_hf.errors import MeshSpecError
    from hp_dcp_hf.integrations.transformers import from_pretrained

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    counts = [_threads()]
    for _ in range(CALLS):
        model, report = from_pretrained(path, dtype=torch.float32, device_mesh=mesh)
        counts.append(_threads())
    tp_group = mesh.get_group("tp")
    on_caller_groups = all(p.device_mesh.get_group("tp") is tp_group
                           for p in model.parameters() if isinstance(p, DTensor))
    sharded = sorted(k for k, p in model.named_parameters() if isinstance(p, DTensor))
    mine = _layout(model)
    try:
        from_pretrained(path, dtype=torch.float32, device_mesh=mesh, distributed_config="dp=2")
        refused = ""
    except MeshSpecError as error:
        refused = str(error)
    # the references, which make groups of their own: after the counts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  distributed_config=DistributedConfig(tp_size=world))
    tp_1d, _ = from_pretrained(path, dtype=torch.float32, device_mesh=init_device_mesh("cpu", (world,)))
    fsdp_1d, _ = from_pretrained(path, dtype=torch.float32,
                                 device_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    fsdp_own, _ = from_pretrained(path, dtype=torch.float32, distributed_config=f"dp={world}")
    return {"counts": counts, "on_caller_groups": on_caller_groups, "sharded": sharded, "full": _full(model),
            "layout": report.layout, "refused": refused,
            "vs_transformers": _same_layout(mine, _layout(theirs)),
            "tp_1d_vs_transformers": _same_layout(_layout(tp_1d), _layout(theirs)),
            "fsdp_1d_vs_own_mesh": _same_layout(_layout(fsdp_1d), _layout(fsdp_own)),
            "fsdp_1d_sharded": all(isinstance(p, DTensor) for p in fsdp_1d.parameters())}


def test_the_callers_mesh_makes_no_groups_and_loads_as_transformers(llama_checkpoint):
    reference = load_reference(llama_checkpoint.path, "llama", torch.float32)
    for rank, result in enumerate(run_ranks(2, _caller_mesh, str(llama_checkpoint.path), timeout=300)):
        print(f"rank {rank}: threads after the mesh {result['counts'][0]}, after {CALLS} calls {result['counts'][-1]}")
        assert result["counts"] == [result["counts"][0]] * (CALLS + 1), (rank, result["counts"])
        assert result["on_caller_groups"] and result["sharded"], rank
        assert result["layout"] and result["layout"][0].startswith("tp=2"), result["layout"]
        assert set(result["full"]) == set(reference)
        assert not [k for k, v in result["full"].items() if not torch.equal(v, reference[k])], rank
        assert result["vs_transformers"] == [], (rank, result["vs_transformers"])
        assert result["tp_1d_vs_transformers"] == [], (rank, result["tp_1d_vs_transformers"])
        assert result["fsdp_1d_vs_own_mesh"] == [] and result["fsdp_1d_sharded"], rank
        assert "dp=1, tp=2" in result["refused"] and "dp=2, tp=1" in result["refused"], result["refused"]
