"""``verl-prefix smoke-data``: inputs for ``python -m verl.trainer.main_ppo`` on CPU (``recipes/grpo_cpu_smoke.sh``).

``text`` writes a tiny model and GSM8K-shaped data (its reward is ``configs/cpu/smoke.yaml``'s); ``vl`` a tiny
Qwen2.5-VL and image prompts (its data set class and reward are the recipe's ``--task vl``), with
``vl_processor``'s image-only processor.
"""
