"""Results as pictures: ``plots`` draws ``verl-prefix report``'s PNGs of bench and replay results;
``dashboard`` builds ``verl-prefix dashboard``'s wandb workspace or offline HTML page from the panels of
``dashboard_spec``.
"""
