"""The verl backend: the ``prefix_fsdp2`` engine, its configs, the ``prefix_sync`` trainer mode, group
balancing, data-parallel lockstep, batch traces and verl's CPU platform. Imports the schedule, never tools."""
