"""The report: one JSON document, a Markdown rendering of it, and two plots.

Everything the Markdown and the plots show is in the JSON (``bench/results/<date>.json``), so a
report can be re-rendered later (``python -m bench --render FILE.json``). The targets of the
project's issue are evaluated here, each with its value and, where missed, the reason the data
gives.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from bench.workloads import human

ORDER = ("limit", "limit-mmap", "dcp", "dcp+rw", "legacy", "torch", "transformers", "dcp@tf-layout")
TRACED = ("dcp", "dcp+rw", "dcp@tf-layout")


def machine() -> dict[str, Any]:
    """Cores, memory, CPU, software versions, load at the time of the call."""
    import torch
    import transformers

    info: dict[str, Any] = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "platform": platform.platform()}
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        info["memory_bytes"] = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1]) * 1024
        cpu = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next((line.split(":", 1)[1].strip() for line in cpu if line.startswith("model name")), None)
        info["load_average"] = os.getloadavg()
    except (OSError, StopIteration):
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            check=True).stdout.strip()
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                                                check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


# -- targets -------------------------------------------------------------------------------------------


def _records(doc: dict[str, Any]):
    for case in doc.get("loads", []):
        for record in case["records"]:
            yield case, record


def _target(name: str, ok: bool | None, value: str, why: str = "") -> dict[str, Any]:
    return {"target": name, "met": ok, "value": value, "note": why}


def evaluate_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: met or not, the measured value, and what explains a miss."""
    out = []
    traced = [(c, r) for c, r in _records(doc) if r["contender"] in TRACED and r.get("amplification")]
    if traced:
        worst = max(traced, key=lambda cr: cr[1]["amplification_max_rank"])
        out.append(_target("read amplification <= 1.01 on every traced case", worst[1]["amplification_max_rank"] <= 1.01,
                           f"worst rank {worst[1]['amplification_max_rank']:.4f} ({worst[1]['contender']}, "
                           f"{worst[0]['workload']} x {worst[0]['world']})"))
    legacy = [(c, r) for c, r in _records(doc) if r["contender"] == "legacy" and r.get("amplification")]
    multi = [(c, r) for c, r in legacy if c["world"] > 1]
    if multi:
        # Legacy reads every tensor a rank holds part of whole: all ranks together read world x the
        # checkpoint. Per rank, against what it needs, that is world x for sharded tensors but 1x for
        # replicated ones (norms), so the bytes-weighted amplification is a hair under world.
        short = [(c, r) for c, r in multi if r["cluster_read_factor"] < c["world"] * 0.999]
        values = ", ".join(f"{c['workload']}x{c['world']}: all ranks read {r['cluster_read_factor']:.2f}x the "
                           f"checkpoint (amplification {r['amplification']:.3f})" for c, r in multi)
        why = "" if not short else "some tensors are held by a subset of ranks only in this layout"
        out.append(_target("legacy reads >= world size x the checkpoint", not short, values, why))
    for workload in sorted({c["workload"] for c, _ in _records(doc)}):
        case = next((c for c in doc["loads"] if c["workload"] == workload and c["world"] == 4), None)
        if case is None:
            continue
        rec = {r["contender"]: r for r in case["records"]}
        dcp, limit, legacy_r = rec.get("dcp", {}), rec.get("limit", {}), rec.get("legacy", {})
        if dcp.get("wall_s") and limit.get("wall_s"):
            ratio = dcp["wall_s"] / limit["wall_s"]
            phases = dcp.get("phases_max_s", {})
            mapped = rec.get("limit-mmap", {}).get("wall_s")
            why = f"dcp {dcp['wall_s']:.3f} s vs raw preadv {limit['wall_s']:.3f} s" + (
                f", raw mapped copies {mapped:.3f} s" if mapped else "")
            if ratio > 1.2:
                why += ("; dcp phases (slowest rank): " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items())
                        + "; the rest is DCP's own steps and the ranks' agreement on failure")
            out.append(_target(f"{workload}: load within 1.2x of the raw-read limit at 4 ranks", ratio <= 1.2,
                               f"{ratio:.2f}x", why))
        rewritten = rec.get("dcp+rw", {})
        if workload == "moe" and rewritten.get("wall_s") and limit.get("wall_s"):
            ratio = rewritten["wall_s"] / limit["wall_s"]
            phases = rewritten.get("phases_max_s", {})
            out.append(_target("moe: dcp+rw (transposed stacked experts) within 2x of the raw-read limit at 4 ranks",
                               ratio <= 2, f"{ratio:.2f}x ({rewritten['wall_s']:.3f} s)",
                               "slowest rank: " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items())))
        if workload == "moe" and dcp.get("phases_max_s", {}).get("plan_s") is not None:
            plan_s = dcp["phases_max_s"]["plan_s"]
            out.append(_target("moe: plan <= 0.03 s per rank at 4 ranks", plan_s <= 0.03, f"{plan_s:.3f} s (slowest rank)",
                               "four ranks plan at once on two cores" if plan_s > 0.03 else ""))
        for peer, ours_name, time_of in (("torch", "dcp", "wall_s"), ("transformers", "dcp@tf-layout", "load_part_s")):
            theirs, ours = rec.get(peer, {}), rec.get(ours_name, {})
            if theirs.get(time_of) and ours.get("wall_s"):
                what = "its load part (convert_and_load_state_dict_in_model), against this project loading into " \
                    "the model transformers built" if peer == "transformers" else "same model and layout"
                out.append(_target(f"{workload}: faster than {peer} at 4 ranks", ours["wall_s"] < theirs[time_of],
                                   f"{theirs[time_of] / ours['wall_s']:.2f}x ({ours_name} {ours['wall_s']:.3f} s, "
                                   f"{peer} {theirs[time_of]:.3f} s)", what))
        if dcp.get("wall_s") and legacy_r.get("wall_s"):
            speedup = legacy_r["wall_s"] / dcp["wall_s"]
            why = "" if speedup >= 3 else ("fixed costs (metadata, planning, DCP collectives) weigh more than the "
                                           "bytes at this checkpoint size" if doc.get("size", 0) < 5e8 else "")
            out.append(_target(f"{workload}: >= 3x faster than legacy at 4 ranks", speedup >= 3, f"{speedup:.2f}x", why))
    growth = [(c, r) for c, r in _records(doc) if r["contender"] in TRACED and r.get("rss_growth_max") is not None]
    if growth:
        worst = max(growth, key=lambda cr: cr[1]["rss_growth_max"])
        out.append(_target("RSS growth per rank beyond its own params <= 128 MiB",
                           worst[1]["rss_growth_max"] <= 128 * 2**20,
                           f"worst {human(worst[1]['rss_growth_max'])} ({worst[1]['contender']}, "
                           f"{worst[0]['workload']} x {worst[0]['world']})"))
    out += remote_targets(doc)
    for sim in doc.get("simulate", []):
        top = [r for r in sim.get("results", []) if r["world"] == 1024 and "plan_s_max" in r]
        for r in top:
            ok = r["plan_s_max"] <= 0.5
            why = (f"the rank-independent composition ({sim['checkpoint_tensors']} checkpoint tensors) takes "
                   f"{r['composition_s']:.2f} s of it; the rank's own items {r.get('items_s_max', float('nan')):.2f} s")
            out.append(_target(f"{sim['arch']} {r['layout']}: 1024-rank plan <= 0.5 s per rank", ok,
                               f"{r['plan_s_max']:.2f} s", why))
            if "spans_plan_s_max" in r:
                worst = max(r["spans_timings"], key=lambda t: t["spans_s"])
                out.append(_target(
                    f"{sim['arch']} {r['layout']}: 1024-rank span plan (build + route own + route others) "
                    f"<= {r['spans_target_s']} s per rank", r["spans_plan_s_max"] <= r["spans_target_s"],
                    f"{r['spans_plan_s_max']:.2f} s (build {worst['build_s']:.2f}, route own {worst['route_own_s']:.3f}, "
                    f"route others {worst['route_others_s']:.2f}; decoding the gathered needs {worst['decode_s']:.2f} "
                    "more)", "" if r["spans_plan_s_max"] <= r["spans_target_s"] else "profile below"))
                out.append(_target(f"{sim['arch']} {r['layout']}: 1024-rank span plan reads each needed byte once",
                                   r["spans_read_over_needed"] == 1.0,
                                   f"{r['spans_read_over_needed']:.4f}x the needed union; "
                                   f"{r['spans_cluster_factor']:.4f}x the checkpoint"))
    return out


# -- markdown --------------------------------------------------------------------------------------------


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "s":
        return f"{value:.3f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "b":
        return human(value)
    if kind == "f":
        return f"{value:.3f}"
    return str(value)


def loads_table(doc: dict[str, Any], worlds: set[int] | None = None) -> str:
    head = ("| workload | ranks | mesh | contender | wall s (median) | vs limit | vs dcp | bytes read / rank (max) | "
            "bytes read, all ranks | amplification | requests / rank (max) | RSS growth / rank (max) | anon growth / rank "
            "(max) | correct |")
    lines = [head, "|" + "|".join("---" for _ in range(14)) + "|"]
    for case in doc.get("loads", []):
        if worlds is not None and case["world"] not in worlds:
            continue
        records = sorted(case["records"], key=lambda r: ORDER.index(r["contender"]) if r["contender"] in ORDER else 99)
        for r in records:
            cells = [case["workload"], str(case["world"]), case["mesh"], r["contender"]]
            if r.get("error") or r.get("skipped"):
                text = (r.get("error") or r.get("skipped")).splitlines()[0][:120].replace("|", "/")
                cells += [("error: " if r.get("error") else "skipped: ") + text] + [""] * 9
            else:
                reads = [b for b in r.get("bytes_read") or [] if b is not None]
                reqs = [q for q in r.get("requests") or [] if q is not None]
                ok = {True: "yes", False: "**NO**", None: "n/a"}[r.get("correct")]
                cells += [_fmt(r.get("wall_s"), "s"), _fmt(r.get("vs_limit"), "x"), _fmt(r.get("vs_dcp"), "x"),
                          _fmt(max(reads) if reads else None, "b"), _fmt(r.get("bytes_read_total"), "b"),
                          _fmt(r.get("amplification"), "f"), _fmt(max(reqs) if reqs else None),
                          _fmt(r.get("rss_growth_max"), "b"), _fmt(r.get("anon_growth_max"), "b"), ok]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def simulate_table(doc: dict[str, Any]) -> str:
    head = ("| model | layout | ranks | mesh | bytes / rank max (mean) | cluster / ckpt | one replica / ckpt | "
            "legacy cluster / ckpt | plan s / rank (composition) | items s (reused composition) | plan peak mem | "
            "pickled plan / rank | items / ranges per rank | planner = closed form |")
    lines = [head, "|" + "|".join("---" for _ in range(14)) + "|"]
    for sim in doc.get("simulate", []):
        for r in sim.get("results", []):
            plan = f"{r['plan_s_max']:.2f} ({r['composition_s']:.2f})" if "plan_s_max" in r else "-"
            lines.append("| " + " | ".join([
                sim["arch"], r["layout"], str(r["world"]), r["mesh"],
                f"{human(r['bytes_per_rank_max'])} ({human(r['bytes_per_rank_mean'])})", f"{r['cluster_factor']:.3f}",
                f"{r['cluster_factor_one_replica']:.3f}", f"{r['legacy_cluster_factor']:.1f}", plan,
                _fmt(r.get("items_s_max"), "s"), _fmt(r.get("plan_peak_bytes"), "b"),
                _fmt(r.get("pickled_plan_bytes_max"), "b"),
                f"{r.get('read_items_max', '-')} / {r.get('ranges_max', '-')}",
                "yes" if r["planner_matches_closed_form"] else "**NO**"]) + " |")
    return "\n".join(lines)


def spans_table(doc: dict[str, Any]) -> str:
    """The simulation's span ownership (every rank planned): one row per world and layout that has it."""
    head = ("| model | layout | ranks | needs (all ranks; per rank max) | needs gathered: per rank max / all ranks "
            "(padded) | spans | cluster reads / ckpt (/ needed) | storage / rank max (mean) | received / rank max "
            "(mean) | sent / rank max (mean) | span plan s / rank: build + route own + route others (+ decode) | "
            "items s / rank, all ranks | needs = closed form |")
    lines = [head, "|" + "|".join("---" for _ in range(13)) + "|"]
    for sim in doc.get("simulate", []):
        for r in sim.get("results", []):
            if "spans_plan_s_max" not in r:
                continue
            worst = max(r["spans_timings"], key=lambda t: t["spans_s"])
            lines.append("| " + " | ".join([
                sim["arch"], r["layout"], str(r["world"]), f"{r['needs_total']}; {r['needs_per_rank_max']}",
                f"{human(r['needs_encoded_bytes_per_rank_max'])} / {human(r['needs_encoded_bytes_total'])} "
                f"({human(r['needs_gathered_bytes_padded'])})", str(r["spans"]),
                f"{r['spans_cluster_factor']:.4f} ({r['spans_read_over_needed']:.4f})",
                f"{human(r['spans_storage_per_rank_max'])} ({human(r['spans_storage_per_rank_mean'])})",
                f"{human(r['spans_received_per_rank_max'])} ({human(r['spans_received_per_rank_mean'])})",
                f"{human(r['spans_sent_per_rank_max'])} ({human(r['spans_sent_per_rank_mean'])})",
                f"**{worst['spans_s']:.2f}** = {worst['build_s']:.2f} + {worst['route_own_s']:.3f} + "
                f"{worst['route_others_s']:.2f} (+ {worst['decode_s']:.2f}), rank {worst['rank']}",
                f"{r['all_ranks_items_s_mean']:.3f}", "yes" if r["spans_needs_match_closed_form"] else "**NO**"]) + " |")
    return "\n".join(lines)


def spans_details(doc: dict[str, Any]) -> list[str]:
    """Per layout with span ownership: every sampled rank's timings (with the load average when
    taken) and, when the plan missed its target, the profile's top functions."""
    out: list[str] = []
    for sim in doc.get("simulate", []):
        for r in sim.get("results", []):
            if "spans_plan_s_max" not in r:
                continue
            out += [f"### {sim['arch']} {r['layout']} {r['world']}: span plan per sampled rank", "",
                    "| rank | decode s | build s | route own s | route others s | build + routes s | sends | "
                    "load average (1, 5, 15 min) |", "|---|---|---|---|---|---|---|---|"]
            out += [f"| {t['rank']} | {t['decode_s']:.2f} | {t['build_s']:.2f} | {t['route_own_s']:.3f} | "
                    f"{t['route_others_s']:.2f} | {t['spans_s']:.2f} | {human(t['sent_bytes'])} | "
                    f"{', '.join(f'{x:.2f}' for x in t['load_average'])} |" for t in r["spans_timings"]]
            out += ["", f"Needs cut to {human(r['spans_chunk_bytes'])} chunks (the reader's batch), spans of at least "
                    f"{human(r['span_bytes'])} (largest {human(r['span_size_max'])}), gap {r['spans_gap']}, "
                    f"{r['spans_nodes']} nodes of 8 ranks; {r['spans_owners']} ranks own spans; requests per rank max "
                    f"{r['spans_requests_per_rank_max']}; exchanged in all {human(r['spans_exchanged_bytes'])}; "
                    f"every rank's traffic computed in {r['spans_traffic_s']:.1f} s; a sampled rank's sends = "
                    f"traffic: {'yes' if r['spans_sent_matches_traffic'] else '**NO**'}; every rank's items planned "
                    f"in {r['all_ranks_items_s']:.0f} s.", ""]
            if r.get("spans_profile"):
                out += [f"cProfile of rank {r['spans_sampled'][0]}'s span plan (decode included; profiled, so "
                        "slower than timed), top functions by own time:", "",
                        "| function | calls | own s | share of own time | cumulative s |", "|---|---|---|---|---|"]
                out += [f"| `{p['function']}` | {p['calls']} | {p['tottime_s']:.2f} | {p['share']:.1%} | "
                        f"{p['cumtime_s']:.2f} |" for p in r["spans_profile"]]
                out.append("")
    return out


def remote_layouts(remote: dict[str, Any]) -> list[dict[str, Any]]:
    """The remote part's meshes; a result from before there were several (one mesh, the ratios of
    ``dcp-s3`` alone at the top) reads as one."""
    if "layouts" in remote:
        return remote["layouts"]
    return [{"mesh": remote["mesh"], "contenders": remote["contenders"], "ratios": {"dcp-s3": remote.get("ratios", {})}}]


def _reads(r: dict[str, Any]) -> str:
    return {True: "cooperative", False: "direct"}.get(r.get("cooperating"), "-") if r["contender"] != "s3fs-whole" else "whole files"


def _exchanged(r: dict[str, Any]) -> int | None:
    """Bytes the ranks sent each other (all ranks, last load); None where nothing was measured."""
    sides = [e for e in r.get("exchange") or [] if e]
    return sum(e["sent"] for e in sides) if sides else None


def remote_section(doc: dict[str, Any]) -> list[str]:
    """The remote row (``doc["remote"]``, :mod:`bench.remote`) as Markdown lines; [] when not run."""
    from bench.remote import PAIRS

    remote = doc.get("remote")
    if not remote:
        return []
    lines = ["## Remote (S3)", ""]
    if remote.get("error") or remote.get("skipped"):
        return lines + [remote.get("skipped") or f"error: {remote['error']}", ""]
    loads = remote["loads"]
    lines += [f"`{remote['url']}` ({human(remote['checkpoint_bytes'])} in {remote['files']} files) on {remote['server']}; "
              f"{remote['world']} ranks, {remote['threads']} threads per rank, every row of a mesh side by side in one "
              f"run. Wall: slowest rank, median of {remote['reps']}. Server: its own counters over all {loads} loads of "
              f"a contender (2xx GETs, HEADs included; bytes sent), divided by {loads}; needed: the union of every "
              "rank's direct plan (each byte once); client: GETs per rank of the last load; exchanged: bytes the ranks "
              "sent each other (all ranks, last load); phases: slowest rank, last load.", ""]
    ok = {True: "yes", False: "**NO**", None: "n/a"}
    for layout in remote_layouts(remote):
        lines += [f"### {layout['mesh']}", ""]
        if layout.get("error"):
            lines += [f"error: {layout['error']}", ""]
            continue
        needed = layout.get("needed_bytes")
        if needed:
            lines += [f"Needed regions: {human(needed)}; every rank reading all it holds fetches "
                      f"{human(layout['direct_bytes'])} ({layout['direct_bytes'] / needed:.2f}x).", ""]
        lines += ["| contender | reads | wall s (median) | vs its limit | server bytes / load | / needed | "
                  "server GETs / load | client GETs / rank | exchanged | plan / read / exchange s | "
                  "bytes read / rank (max) | RSS growth / rank (max) | correct |",
                  "|" + "|".join("---" for _ in range(13)) + "|"]
        for r in layout["contenders"]:
            if r.get("error"):
                lines.append(f"| {r['contender']} | error: {r['error'].splitlines()[0][:120].replace('|', '/')} |"
                             + " |" * 11)
                continue
            read = [b for b in r["bytes_read"] if b is not None]
            per_load = r["server"]["bytes"] / loads
            limit = layout["ratios"].get(r["contender"], {}).get(PAIRS.get(r["contender"]), {}).get("wall")
            phases = r.get("phases_max_s") or {}
            shown = " / ".join(f"{phases[k]:.3f}" for k in ("plan_s", "read_s", "exchange_s") if k in phases)
            lines.append("| " + " | ".join([
                r["contender"], _reads(r), _fmt(r["wall_s"], "s"), _fmt(limit, "x"), _fmt(per_load, "b"),
                f"{per_load / needed:.3f}x" if needed and per_load else "-", f"{r['server']['gets'] / loads:.0f}",
                " / ".join(map(str, r["client_gets"])), _fmt(_exchanged(r), "b"), shown or "-",
                _fmt(max(read) if read else None, "b"), _fmt(r.get("rss_growth_max"), "b"), ok[r.get("correct")]]) + " |")
        for ours, against in layout["ratios"].items():
            shown = "; ".join(f"{ratio['wall']:.2f}x the wall time of {name}" + (
                f" with {ratio['server_bytes']:.2f}x its server bytes" if "server_bytes" in ratio else "")
                for name, ratio in against.items())
            lines += ["", f"{ours} took {shown}."]
        lines.append("")
    return lines


def remote_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The remote targets of every mesh: cluster bytes (cooperative rows), limit, whole files."""
    from bench.remote import PAIRS

    remote, out = doc.get("remote") or {}, []
    if not remote.get("loads"):
        return out
    for layout in remote_layouts(remote):
        recs = {r["contender"]: r for r in layout.get("contenders", []) if r.get("wall_s")}
        for ours, limit_name in PAIRS.items():
            r = recs.get(ours)
            if r is None:
                continue
            label = f"remote {layout['mesh']}, {ours} ({_reads(r)})"
            phases = r.get("phases_max_s") or {}
            profile = "slowest rank: " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()) if phases else ""
            needed = layout.get("needed_bytes")
            if r.get("cooperating") and needed:
                per_load = r["server"]["bytes"] / remote["loads"]
                factor = per_load / (needed + (r.get("header_bytes") or 0))
                out.append(_target(f"{label}: cluster bytes 1.00x the needed regions (+ headers)", round(factor, 2) <= 1,
                                   f"{factor:.3f}x ({human(per_load)} per load; needed {human(needed)}, headers "
                                   f"{human(r.get('header_bytes') or 0)})",
                                   "" if round(factor, 2) <= 1 else
                                   f"{human(per_load - needed - (r.get('header_bytes') or 0))} beyond them"))
            limit = recs.get(limit_name)
            if limit:
                ratio = r["wall_s"] / limit["wall_s"]
                out.append(_target(f"{label}: within 1.15x of the limit ({limit_name})", ratio <= 1.15,
                                   f"{ratio:.2f}x ({r['wall_s']:.3f} s vs {limit['wall_s']:.3f} s)",
                                   "" if ratio <= 1.15 else profile))
            whole = recs.get("s3fs-whole")
            if whole:
                out.append(_target(f"{label}: faster than whole-file download (s3fs-whole)", r["wall_s"] < whole["wall_s"],
                                   f"{whole['wall_s'] / r['wall_s']:.1f}x faster ({whole['wall_s']:.3f} s)"))
    return out


def quantized_section(doc: dict[str, Any]) -> list[str]:
    """The quantized part (``doc["quantized"]``, :mod:`bench.quantized`) as Markdown lines; [] when not run."""
    q = doc.get("quantized")
    if not q:
        return []
    lines = ["## Quantized (FP8 block-scaled MoE into bf16)", ""]
    if q.get("error"):
        return lines + [f"error: {q['error']}", ""]
    quant = q.get("quantization") or {}
    lines += [f"`{q['checkpoint']}`: {q['model_class']}, {q['num_layers']} layers, {human(q['checkpoint_bytes'])} in "
              f"{q['files']} files ({q['tensors']} tensors; {human(q['bf16_bytes'] or 0)} as bf16 before quantization), "
              f"{quant.get('format')}: {quant.get('weights')} weights, {human(quant.get('weight_bytes') or 0)} FP8 + "
              f"{human(quant.get('scale_bytes') or 0)} scales; the rest bf16. {q['world']} ranks, mesh {q['mesh']} "
              f"(transformers' plans), {q['threads']} threads per rank, {q['warmup']} warm-up + {q['reps']} timed loads; "
              "wall: slowest rank, median. Bytes per rank (max over ranks); dcp's and limit's split into FP8 "
              "weights / scales / bf16 tensors as planned. Dequantize: the planner's `_dequantize` calls on the "
              "reader threads, wall time during which one ran over the rank's load (range over ranks).", "",
              "| contender | wall s (median) | vs limit | vs dcp | bytes read / rank | FP8 / scales / bf16 per rank | "
              "requests / rank | dequantize share | RSS growth / rank | correct |",
              "|" + "|".join("---" for _ in range(10)) + "|"]
    records = {r["contender"]: r for r in q["contenders"]}
    limit, dcp = records.get("limit", {}).get("wall_s"), records.get("dcp", {}).get("wall_s")
    ok = {True: "yes", False: "**NO**", None: "n/a"}
    for r in q["contenders"]:
        ranks = r.get("per_rank", [])
        reads = [p["bytes_read"] for p in ranks if p.get("bytes_read") is not None]
        reqs = [p["requests"] for p in ranks if p.get("requests") is not None]
        split = "-"
        if ranks and ranks[0].get("quantized_bytes") is not None:
            top = max(ranks, key=lambda p: p["bytes_needed"])
            split = f"{human(top['quantized_bytes'])} / {human(top['scale_bytes'])} / {human(top['plain_bytes'])}"
        shares = [p["dequant_share"] for p in ranks if p.get("dequant_share") is not None]
        share = f"{min(shares):.0%}-{max(shares):.0%}" if shares else "-"
        wall = _fmt(r.get("wall_s"), "s") if r.get("wall_s") else ("**error**" if r.get("errors") else "-")
        growth = [p["rss_growth"] for p in ranks if p.get("rss_growth") is not None]
        lines.append("| " + " | ".join([
            r["contender"], wall, _fmt(r["wall_s"] / limit if r.get("wall_s") and limit else None, "x"),
            _fmt(r["wall_s"] / dcp if r.get("wall_s") and dcp else None, "x"), _fmt(max(reads) if reads else None, "b"),
            split, _fmt(max(reqs) if reqs else None), share, _fmt(max(growth) if growth else None, "b"),
            f"**NO**: failed on {len(r['errors'])} of {r['ranks']} ranks, {r.get('mismatched_count', 0)} tensors differ "
            "on the others" if r.get("errors") else ok[r.get("correct")]]) + " |")
    lines += ["", "Per rank (own time: median of the timed loads; for a contender that failed on some ranks, the time "
              "each rank took to load or to raise):", "",
              "| contender | rank | own s | bytes read | dcp phases: metadata / plan / read s | dequantize busy / summed s "
              "(share) | outcome |", "|---|---|---|---|---|---|---|"]
    for r in q["contenders"]:
        for p in r.get("per_rank", []):
            phases = p.get("phases") or {}
            phase = " / ".join(f"{phases[k]:.3f}" for k in ("metadata_s", "plan_s", "read_s") if k in phases) or "-"
            deq = (f"{p['dequant_busy_s']:.3f} / {p['dequant_sum_s']:.3f} ({p['dequant_share']:.0%})"
                   if p.get("dequant_busy_s") is not None else "-")
            outcome = ("error: " + p["error"].splitlines()[0][:100].replace("|", "/")) if p.get("error") else "loaded"
            lines.append(f"| {r['contender']} | {p['rank']} | {_fmt(p.get('own_s'), 's')} | "
                         f"{_fmt(p.get('bytes_read'), 'b')} | {phase} | {deq} | {outcome} |")
    ratios = q.get("ratios", {})
    names = {"dcp_vs_limit": "dcp / limit", "torch_vs_dcp": "torch / dcp", "transformers_vs_dcp": "transformers / dcp",
             "transformers_load_part_vs_dcp": "transformers' load part / dcp",
             "transformers_loaded_ranks_vs_dcp": "transformers / dcp on the ranks where transformers loaded"}
    if ratios:
        lines += ["", "Wall-time ratios, same run: " + "; ".join(f"{names.get(k, k)} {v:.2f}x" for k, v in ratios.items())
                  + "."]
    lines.append("")
    for r in q["contenders"]:
        notes = []
        if r.get("errors"):
            notes.append(f"failed on ranks {', '.join(sorted(r['errors']))} ({r.get('failed_at') or 'first load'}): "
                         + "; ".join(sorted({e.splitlines()[0][:200] for e in r["errors"].values()}))
                         + (f", raised in {r['raised_in']}" if r.get("raised_in") else ""))
        if r.get("check") and r.get("correct") is not None:
            differing = r.get("differing") or {}
            notes.append(f"values {r['check']}: {r.get('mismatched_count', 0)} differ"
                         + (f" (ranks checked: {r.get('checked_ranks')}"
                            + (f"; tensors compared: {r['compared_tensors']})" if r.get("compared_tensors") else ")")
                            if r.get("checked_ranks") is not None else "")
                         + ("; e.g. " + "; ".join(f"{k}: {v}" for k, v in list(differing.items())[:3]) if differing else ""))
        if r.get("layout_differs"):
            notes.append(f"not compared (layout differs from dcp's): {', '.join(r['layout_differs'][:5])}")
        notes += r.get("notes", [])
        lines += [f"- `{r['contender']}`: {n}" for n in notes]
    return lines + [""]


def render_markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    parts = [f"# hp-dcp-hf benchmark, {doc['date']}", "",
             f"Machine: {m.get('cores')} cores ({m.get('cpu') or 'unknown CPU'}), "
             f"{human(m.get('memory_bytes') or 0)} memory, torch {m.get('torch')}, transformers {m.get('transformers')}, "
             f"Python {m.get('python')}; git {m.get('git_commit', '?')}{' (dirty)' if m.get('git_dirty') else ''}; "
             f"load average at start {doc.get('load_average_start')}, at end {m.get('load_average')}.",
             "", f"Settings: {doc['settings']}", "",
             "All contenders read the same checkpoint on the same ranks (gloo, spawned processes), each from a warm "
             "page cache (every file read once right before each contender's process group starts). Wall time: "
             "the slowest rank, median of the repetitions after warm-up. Amplification: bytes read / bytes this "
             "project's plan needs for the same layout. RSS growth: peak RSS during the load minus RSS before it "
             "(the rank's own parameters were already resident; for transformers, which builds its model inside the "
             "call, minus its local parameter bytes); it includes checkpoint pages an mmap-based reader maps (page "
             "cache, shared), which the anonymous-memory column leaves out.", ""]
    if doc.get("notes"):
        parts += ["## Notes", ""] + [f"- {line}" for line in doc["notes"]] + [""]
    if doc.get("workloads"):
        parts += ["## Workloads", ""]
        parts += [f"- `{w['kind']}`: {w['model_class']}, {w['num_layers']} layers, {w['tensors']} tensors in "
                  f"{w['files']} files, {human(w['checkpoint_bytes'])}" for w in doc["workloads"]]
        parts.append("")
    if doc.get("loads"):
        parts += ["## Loads", "", loads_table(doc), ""]
        notes = sorted({f"{r['contender']}: {n}" for _, r in _records(doc) for n in r.get("notes", [])})
        parts += [f"- {n}" for n in notes] + ([""] if notes else [])
    if doc.get("real"):
        r = doc["real"]
        parts += ["## Real checkpoint", ""]
        if r.get("skipped") or r.get("error"):
            parts += [r.get("skipped") or f"error: {r['error']}", ""]
        else:
            parts += [f"{r['model']}, {len(r['files'])} files ({human(r['checkpoint_bytes'])}), {r['world']} ranks: "
                      f"{r['how']}.", "",
                      f"Load {r['load_s_max']:.3f} s (slowest rank); bytes read per rank "
                      f"{', '.join(human(b) for b in r['bytes_read'])}; amplification {r['amplification']:.4f}; "
                      f"requests per rank {r['requests']}. Logits vs single-process transformers: max abs diff "
                      f"{r['logits_max_abs_diff']:.2e} (close: {r['logits_close']}); next token for "
                      f"\"{r['prompt']}\": {r['next_token']!r} (transformers: {r['reference_next_token']!r}).", ""]
    if doc.get("simulate"):
        parts += ["## Cluster-scale planning (simulated)", "", simulate_table(doc), ""]
        if spans_table(doc).count("\n") > 1:
            parts += ["## Cooperative reads by span ownership (simulated, every rank planned)", "", spans_table(doc), "",
                      *spans_details(doc)]
    if doc.get("multinode"):
        mn = doc["multinode"]
        parts += ["## Multi-node smoke", ""]
        if mn.get("error") or mn.get("skipped"):
            parts += [mn.get("error") or mn.get("skipped"), ""]
        else:
            parts += [f"Two torchrun launchers (`--nnodes 2 --nproc-per-node 2`, static rendezvous on 127.0.0.1), "
                      f"mesh {mn['mesh']}: correct on every rank: {mn['correct']}; wall "
                      f"{max(r['wall_s'] for r in mn['ranks']):.3f} s; bytes read per rank "
                      f"{', '.join(human(r['bytes_read']) for r in mn['ranks'])}.", ""]
    parts += remote_section(doc)
    parts += quantized_section(doc)
    if doc.get("targets"):
        parts += ["## Targets", "", "| target | met | value | note |", "|---|---|---|---|"]
        parts += [f"| {t['target']} | {'yes' if t['met'] else '**no**'} | {t['value']} | {t['note']} |"
                  for t in doc["targets"]]
        parts.append("")
    if doc.get("not_run"):
        parts += ["## Not run", ""] + [f"- {line}" for line in doc["not_run"]] + [""]
    return "\n".join(parts)


def readme_summary(doc: dict[str, Any], json_path: str) -> str:
    """The part of a report that goes into README: the loads at the largest world size, the targets."""
    largest = max((c["world"] for c in doc.get("loads", [])), default=None)
    m = doc["machine"]
    parts = [f"From `{json_path}` ({doc['settings']['size']} checkpoints; {m.get('cores')} cores, "
             f"{human(m.get('memory_bytes') or 0)}, torch {m.get('torch')}; load average "
             f"{', '.join(f'{x:.1f}' for x in m.get('load_average') or ())} at the end), {largest} ranks; "
             "every world size, the real checkpoint and the simulation are in the full report next to it.", ""]
    if largest is not None:
        parts += [loads_table(doc, {largest}), ""]
    if doc.get("targets"):
        parts += ["| target | met | value |", "|---|---|---|"]
        parts += [f"| {t['target']} | {'yes' if t['met'] else '**no**'} | {t['value']} |" for t in doc["targets"]]
    return "\n".join(parts)


# -- plots -----------------------------------------------------------------------------------------------


def plot(doc: dict[str, Any], stem: Path) -> list[Path]:
    """``<stem>-time.png`` (wall time vs world size) and ``<stem>-bytes.png`` (bytes read per rank)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    workloads = sorted({c["workload"] for c in doc.get("loads", [])})
    if not workloads:
        return []
    out = []
    for metric, ylabel, suffix in (("wall_s", "load wall time, s (median)", "time"),
                                   ("bytes_max", "bytes read per rank, max (MiB)", "bytes")):
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            series: dict[str, list[tuple[int, float]]] = {}
            for case in doc["loads"]:
                if case["workload"] != workload:
                    continue
                for r in case["records"]:
                    if metric == "wall_s":
                        value = r.get("wall_s")
                    else:
                        reads = [b for b in r.get("bytes_read") or [] if b is not None]
                        value = max(reads) / 2**20 if reads else None
                    if value:
                        series.setdefault(r["contender"], []).append((case["world"], value))
            for name in sorted(series, key=lambda n: ORDER.index(n) if n in ORDER else 99):
                points = sorted(series[name])
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name,
                        linestyle="--" if name == "limit" else "-")
            ax.set_title(f"{workload}")
            ax.set_xlabel("ranks")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            worlds = sorted({c["world"] for c in doc["loads"] if c["workload"] == workload})
            ax.set_xticks(worlds, [str(w) for w in worlds])
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{suffix}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


def write_report(doc: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``<date>.json``, ``<date>.md`` and the plots into ``out_dir``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc.setdefault("date", dt.date.today().isoformat())
    doc["targets"] = evaluate_targets(doc)
    stem = out_dir / doc.get("name", doc["date"])
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    pngs = plot(doc, stem)
    doc["plots"] = [p.name for p in pngs]
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = render_markdown(doc) + "".join(f"\n![{p.stem}]({p.name})\n" for p in pngs)
    md_path = stem.with_suffix(".md")
    md_path.write_text(md)
    return {"json": json_path, "markdown": md_path, **{p.stem: p for p in pngs}}
