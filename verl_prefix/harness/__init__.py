"""The test harness: tiny random-init models, verl engines built in this process, GRPO batches and the model
zoo, for the tests, the benchmarks and the CPU tools. Everything goes through verl's real code paths, on CPU
in a single process. Imports the backend and the schedule; only ``tools`` (and the tests) import it.

``testing`` builds verl's engines and GRPO batches; ``vl`` the vision-language models and image-prompt batches;
``titan`` the torchtitan flavors and TorchTitan engines; ``model_zoo`` a tiny config of every decoder family.
"""
