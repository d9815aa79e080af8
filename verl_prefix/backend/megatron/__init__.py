"""verl's Megatron engine (megatron-core) under this package: for now its CPU platform layer alone.

``platform`` adapts megatron-core 0.16.1, Megatron-Bridge 0.3.1, mbridge 0.15.1 and verl 0.9.1's Megatron engine to
a host without CUDA (gloo, fp32), so that the engine can be built, trained and compared on CPU like the FSDP and
TorchTitan engines (docs/megatron.md). Importing this package imports nothing; megatron-core is optional
(``scripts/setup.sh`` installs it) and loads when ``platform.ensure_megatron_platform`` runs.
"""
