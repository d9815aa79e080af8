"""The verl backend: the three prefix engines (``prefix_fsdp2`` in ``fsdp/``, ``prefix_torchtitan`` in ``titan/``,
``prefix_megatron`` in ``megatron/``) over the one mini-batch driver (``driver``), their configs, the one registry
helper (``registry``), the trainer hooks (selection, group balancing, the ``prefix_sync`` alias), data-parallel
lockstep, batch traces and verl's CPU platform. Imports the schedule, never tools."""
