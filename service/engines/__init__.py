"""The engine backends behind the engine seam (``service/engine.py``), each imported only when
the service starts it:

- ``vllm``: vLLM's ``AsyncLLM`` in this process (``vllm_host``: what it needs of the host;
  ``vllm_rl``: its RL control API; ``one_at_a_time``: the order of the RL calls that change it;
  ``checkpoints``: what a reload's files are checked for before the engine reads them);
- ``upstream``: a running ``vllm serve`` over HTTP;
- ``synthetic``: deterministic routes without a model.

What patches or extends vLLM itself (its plugins, the routing-weight capture, the CPU shims)
lives in ``service/vllm_patches``.
"""
