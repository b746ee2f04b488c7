"""The demo's own statements (the demo itself is ``make demo``: a 210 MB checkpoint on 4 ranks)."""

from __future__ import annotations

import pytest
import torch

from hp_dcp_hf.tools.demo import DEMO_DTYPE, dtype_line


@pytest.mark.parametrize(("dtype", "default"), [(torch.bfloat16, "bfloat16"), (torch.float32, None)])
def test_the_demo_s_dtype_is_not_taken_for_the_default(tiny_checkpoints, dtype, default):
    """The demo builds its models in float32; for a bf16 checkpoint it says that the default
    (``dtype="auto"``, as transformers') would build bf16."""
    line = dtype_line(str(tiny_checkpoints("mixtral", dtype).path))
    assert line.startswith(DEMO_DTYPE)
    if default is None:
        assert line == DEMO_DTYPE
    else:
        assert f"by default, dtype='auto', this checkpoint loads as {default}" in line
