"""The cooperative read mode: span ownership (:mod:`hp_dcp_hf.storage.read.span_reads`). Each rank
reads the spans it owns and the ranks exchange the raw bytes each needs, so the cluster reads every
needed byte once. Every rank raises the same error when one fails, marked ``agreed`` (no rank needs
to agree on it again). With ``cooperate="auto"`` the ranks first see whether that pays
(:mod:`hp_dcp_hf.storage.read.payoff`), and read directly where it does not."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from hp_dcp_hf.storage.read.chunks import Chunk, Chunker, committer, destination, meta_destinations
from hp_dcp_hf.storage.read.direct import DirectRead
from hp_dcp_hf.storage.read.exchange import typed
from hp_dcp_hf.storage.read.mode import ReadRecord
from hp_dcp_hf.storage.read.options import ReadSettings
from hp_dcp_hf.storage.read.payoff import ReadCost, cooperation_pays, direct_cost, span_costs
from hp_dcp_hf.storage.read.span_reads import GatheredPlan, StoredTable, gather_plan, node_id, read_spans
from hp_dcp_hf.storage.read.spans import ClusterPlan, Traffic, traffic
from hp_dcp_hf.util.collectives import agree_on_failure


class CooperativeRead:
    """Reads ``settings``' checkpoint together with the other ranks, by their chunks (cut by ``chunker``)."""

    def __init__(self, settings: ReadSettings, chunker: Chunker) -> None:
        self.settings, self.chunker = settings, chunker

    def plan(
        self, items_by_rank: Sequence[Sequence[ReadItem]], nodes: Sequence[str] | None = None
    ) -> tuple[ClusterPlan, list[Traffic], bool]:
        """The span ownership of a load whose ranks plan ``items_by_rank`` (on ``nodes``, default one
        node each), each rank's :class:`Traffic`, and whether cooperating pays for it (what
        ``cooperate="auto"`` decides), without any I/O: what :meth:`read` builds."""
        settings = self.settings
        table = StoredTable.of(self.chunker.entries)
        needs = [table.needs(self.chunker.by_file(items, meta_destinations(items))) for items in items_by_rank]
        node_ids = [node_id(n) for n in nodes] if nodes is not None else None
        plan = ClusterPlan.build(table.tensors, needs, table.files, nodes=node_ids, gap=settings.span_gap,
                                 span_bytes=settings.options.span_bytes)
        direct = tuple(direct_cost(n, table.tensors, settings.gap, settings.batch_bytes) for n in needs)
        shares = traffic(plan, needs, settings.batch_bytes)
        return plan, shares, self._pays(plan, direct)

    def _pays(self, plan: ClusterPlan, direct: Sequence[ReadCost]) -> bool:
        """Whether the load reads ``plan``'s spans: always with ``cooperate="always"``, else where it
        pays over the ranks' ``direct`` reads."""
        if self.settings.options.cooperate == "always":
            return True
        shares = span_costs(plan.owner, plan.end - plan.start, plan.world, self.settings.batch_bytes)
        return cooperation_pays(direct, shares)

    def read(self, plan: LoadPlan, planner: LoadPlanner, record: ReadRecord) -> None:
        """Every rank gathers the others' needs and plans the spans; where cooperating does not pay
        (:mod:`hp_dcp_hf.storage.read.payoff`), every rank reads its own items directly instead."""
        settings, options = self.settings, self.settings.options
        assert settings.location is not None
        error: BaseException | None = None
        chunks: list[Chunk] = []
        try:
            dests = [destination(item, planner) for item in plan.items]
            chunks = self.chunker.by_file(plan.items, dests)
        except Exception as e:  # noqa: BLE001 - agreed on before any collective of the exchange
            error = e
        # Every rank planned before any exchanges: a rank whose planning failed is agreeing on its
        # error in load_hf_checkpoint, and this matches that collective.
        error = agree_on_failure(error)
        if error is None:
            table = StoredTable.of(self.chunker.entries)
            try:
                gathered = gather_plan(table=table, chunks=chunks, node=options.node, gap=settings.span_gap,
                                       span_bytes=options.span_bytes, direct_gap=settings.gap,
                                       request_bytes=settings.batch_bytes)
                record.cooperated = self._pays(gathered.plan, gathered.direct)
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                error = e
            if error is None and not record.cooperated:
                # the same decision on every rank, from the same gathered needs; a failure of these
                # reads is agreed on by load_hf_checkpoint, as a direct load's
                record.seconds["spans"] = time.perf_counter() - gathered.began
                DirectRead(settings, self.chunker).read_into(dests, chunks, plan, planner, record)
                return
            if error is None:
                error = self._read_spans(gathered, table, chunks, dests, plan, planner, record)
            try:
                error = agree_on_failure(error)
            except Exception as e:  # noqa: BLE001 - a rank left: this rank's own error, or the lost agreement
                error = error or typed(e, "agreeing on the load's outcome failed (did a rank leave the load?): ")
        if error is not None:
            error.agreed = True  # type: ignore[attr-defined]
            raise error

    def _read_spans(self, gathered: GatheredPlan, table: StoredTable, chunks: list[Chunk], dests: list[torch.Tensor],
                    plan: LoadPlan, planner: LoadPlanner, record: ReadRecord) -> BaseException | None:
        """This rank's part of the cooperative read of ``gathered``'s plan; its error, if any."""
        settings, options = self.settings, self.settings.options
        assert settings.location is not None
        chunk_done = committer(plan, planner, chunks, dests)
        log = record.requests.append if record.requests is not None else None

        def finished(index: int) -> None:
            with record.converting():
                chunk_done(chunks[index].item)

        try:
            load = read_spans(
                gathered, location=settings.location, table=table, chunks=chunks, finished=finished,
                request_bytes=settings.batch_bytes, threads=settings.threads, budget=options.staging_bytes,
                stats=record.stats, log=(lambda f, s, e: log((f, s, e))) if log is not None else None,
                direct_io=options.direct_io, landed=record.landed,
                writing=lambda index: record.writing((chunks[index].item,)),
            )
            record.spans = load
            record.seconds.update(load.seconds)
        except Exception as e:  # noqa: BLE001 - every rank learns of it in the caller
            return e
        return None
