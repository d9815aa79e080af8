"""``prefix_megatron``: the one schedule on verl's Megatron engine (megatron-core), and its CPU platform layer.

``registry`` registers the engine as a factory; ``engine`` adapts verl's ``MegatronEngineWithLMHead`` to the mini-batch
driver; ``causal_lm``, ``attention``, ``moe`` and ``recompute`` put megatron-core's model under the schedule's calls;
``config`` holds the engine config and its refusals.

``platform`` adapts megatron-core 0.16.1, Megatron-Bridge 0.3.1, mbridge 0.15.1 and verl 0.9.1's Megatron engine to
a host without CUDA (gloo, fp32), so that the engine can be built, trained and compared on CPU like the FSDP and
TorchTitan engines (docs/megatron.md). Importing this package imports nothing; megatron-core is optional
(``scripts/setup.sh`` installs it) and loads when ``platform.ensure_megatron_platform`` runs.
"""
