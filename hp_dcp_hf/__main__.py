"""``python -m hp_dcp_hf``: the ``hp-dcp-hf`` command line (see :mod:`hp_dcp_hf.tools.cli`)."""

from hp_dcp_hf.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
