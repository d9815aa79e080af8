"""The test harness: tiny random-init models, verl engines built in this process, GRPO batches and the model
zoo, for the tests, the benchmarks and the CPU tools. Everything goes through verl's real code paths, on CPU
in a single process. Imports the backend and the schedule; only ``tools`` (and the tests) import it.

``tiny_models`` writes tiny random-init model directories and their tokenizer; ``verl_engine`` builds verl's
engines and runs their updates and forward passes as verl's worker does; ``grpo_batches`` makes GRPO mini-batches;
``vl`` the vision-language models and image-prompt batches; ``titan`` the torchtitan flavors and TorchTitan
engines; ``model_zoo`` a tiny config of every decoder family of transformers.
"""
