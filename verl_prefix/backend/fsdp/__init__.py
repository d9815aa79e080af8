"""``prefix_fsdp2``: the driver's adapter for verl's FSDP2 engine over an HF causal LM (``engine``), the model
checks it runs at build and per mini-batch (``model_checks``) and the settings it refuses at initialisation
(``refusals``)."""
