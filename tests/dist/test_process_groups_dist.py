"""Process groups are made once per process: repeated loads and saves leave no threads behind.

On 2 gloo ranks, a process calls ``from_pretrained(..., distributed_config="dp=1,tp=2")`` ten
times, then ``save_hf_checkpoint`` ten times, then ten cooperative loads (``cooperate="always"``)
into the model: the OS thread count of each rank (``/proc/self/task``, gloo's threads included)
after the tenth call of each is the count after the first; before the groups were reused, every
``from_pretrained`` added 18. The tenth model holds exactly the first's values.
:func:`~hp_dcp_hf.parallel.init_mesh` answers the same spec with the same mesh, and a new one
once the default group was destroyed and made again.
"""

from __future__ import annotations

import os
import time

import torch
from torch.distributed.tensor import DTensor

from hp_dcp_hf.tools.launch import free_port, run_ranks

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
