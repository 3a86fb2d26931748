"""Integrations of gms with serving engines.

Each sits on top of ``gms.client`` and ``gms.torch`` and imports its engine
only where it must, so that its configuration and naming can be used (and
tested) where the engine is not installed.

* ``gms.integrations.vllm``: vLLM's ``--load-format gms`` (docs/vllm.md).
"""
