"""Benchmarks (``routereplay bench store|service|trainer|routes|scale``) and the server
processes they start.

Tooling above every layer: it imports the client, the service and the trainer adapter through
their public names only; nothing imports it but the CLI and the tests.
"""
