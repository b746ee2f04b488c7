"""The cooperative read mode: span ownership (:mod:`hp_dcp_hf.storage.read.span_reads`). Each rank
reads the spans it owns and the ranks exchange the raw bytes each needs, so the cluster reads every
needed byte once. Every rank raises the same error when one fails, marked ``agreed`` (no rank needs
to agree on it again)."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from hp_dcp_hf.storage.read.chunks import Chunk, Chunker, committer, destination, meta_destinations
from hp_dcp_hf.storage.read.exchange import typed
from hp_dcp_hf.storage.read.mode import ReadRecord
from hp_dcp_hf.storage.read.options import ReadSettings
from hp_dcp_hf.storage.read.span_reads import StoredTable, node_id, read_spans
from hp_dcp_hf.storage.read.spans import ClusterPlan, Traffic, traffic
from hp_dcp_hf.util.collectives import agree_on_failure


class CooperativeRead:
    """Reads ``settings``' checkpoint together with the other ranks, by their chunks (cut by ``chunker``)."""

    def __init__(self, settings: ReadSettings, chunker: Chunker) -> None:
        self.settings, self.chunker = settings, chunker

    def plan(
        self, items_by_rank: Sequence[Sequence[ReadItem]], nodes: Sequence[str] | None = None
    ) -> tuple[ClusterPlan, list[Traffic]]:
        """The span ownership of a load whose ranks plan ``items_by_rank`` (on ``nodes``, default one
        node each), and each rank's :class:`Traffic`, without any I/O: what :meth:`read` builds."""
        table = StoredTable.of(self.chunker.entries)
        needs = [[table.need(c) for c in self.chunker.by_file(items, meta_destinations(items))]
                 for items in items_by_rank]
        node_ids = [node_id(n) for n in nodes] if nodes is not None else None
        plan = ClusterPlan.build(table.tensors, needs, table.files, nodes=node_ids, gap=self.settings.span_gap,
                                 span_bytes=self.settings.options.span_bytes)
        return plan, traffic(plan, needs, self.settings.batch_bytes)

    def read(self, plan: LoadPlan, planner: LoadPlanner, record: ReadRecord) -> None:
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
            chunk_done = committer(plan, planner, chunks, dests)
            log = record.requests.append if record.requests is not None else None

            def finished(index: int) -> None:
                with record.converting():
                    chunk_done(chunks[index].item)

            try:
                load = read_spans(
                    location=settings.location, table=StoredTable.of(self.chunker.entries), chunks=chunks,
                    finished=finished,
                    gap=settings.span_gap, span_bytes=options.span_bytes, request_bytes=settings.batch_bytes,
                    threads=settings.threads, budget=options.staging_bytes, node=options.node,
                    stats=record.stats, log=(lambda f, s, e: log((f, s, e))) if log is not None else None,
                    direct_io=options.direct_io, landed=record.landed,
                )
                record.spans = load
                record.seconds.update(load.seconds)
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                error = e
            try:
                error = agree_on_failure(error)
            except Exception as e:  # noqa: BLE001 - a rank left: this rank's own error, or the lost agreement
                error = error or typed(e, "agreeing on the load's outcome failed (did a rank leave the load?): ")
        if error is not None:
            error.agreed = True  # type: ignore[attr-defined]
            raise error
