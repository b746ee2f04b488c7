"""Tools over the library, which the library never imports: the CLI (:mod:`.cli`, one module per
command), the checkpoint report (:mod:`.inspection`), the fake-rank plan (:mod:`.rank_plans`,
:mod:`.fake_ranks`), progress (:mod:`.progress`), what they print (:mod:`.formatting`), the demo and
the launcher of one host's ranks (:mod:`.launch`)."""
