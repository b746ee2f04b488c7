"""``hp-dcp-hf``: inspect a checkpoint, plan every rank's reads, load under torchrun, run the demo.

    hp-dcp-hf inspect PATH [--tensors] [--match REGEX] [--json]
    hp-dcp-hf plan PATH --mesh dp=2,tp=2 [--transforms fuse_qkv,...] [--items] [--json]
    torchrun --nproc-per-node 4 -m hp_dcp_hf load PATH --mesh dp=2,tp=2 [--forward] [--json]
    hp-dcp-hf load PATH --mesh dp=2,tp=2 --nproc-per-node 4     (one host, ranks started by the package)
    hp-dcp-hf repair PATH [--dry-run]
    hp-dcp-hf demo [--out DIR] [--cache-dir DIR]

Every command that takes a checkpoint PATH takes ``--storage-option KEY=VALUE`` (repeatable).

:mod:`.entry` is the top-level parser and ``main``; each command is one module (:mod:`.inspect`,
:mod:`.plan`, :mod:`.load`, :mod:`.repair`, :mod:`.demo`) that adds its sub-parser and runs it, with
what several share in :mod:`.arguments`, :mod:`.storage_options` and :mod:`.messages`. They import
the work (:mod:`hp_dcp_hf.tools.inspection`, :mod:`~hp_dcp_hf.tools.rank_plans`,
:mod:`~hp_dcp_hf.tools.progress`, the library) inside the command that needs it, so ``--help``
never imports torch or transformers.
"""

from hp_dcp_hf.tools.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
