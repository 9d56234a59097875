"""Experiments and examples that join every layer: the Qwen3-MoE Hugging Face <-> Megatron bridge
(``bridge``), the RL loop on one machine (``rl_loop``). Tooling above the layers, like
``routereplay.bench``: it imports them through their public names."""
