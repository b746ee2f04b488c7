"""vLLM's weight-transfer API driven by hp-dcp-hf's sync (``docs/sync.md``): the ``hp_dcp_hf``
backend, registered with vLLM through its ``vllm.general_plugins`` entry point. Needs vLLM (0.32);
nothing else in hp-dcp-hf imports this package."""
