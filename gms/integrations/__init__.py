"""Integrations of gms with serving engines.

Each sits on top of ``gms.client`` and ``gms.torch`` and imports its engine
only where it must, so that its configuration and naming can be used (and
tested) where the engine is not installed.

* ``gms.integrations.common``: what every engine shares (configuration,
  layout names and identity, an engine process's layouts, publishing).
* ``gms.integrations.vllm``: vLLM's ``--load-format gms`` (docs/vllm.md).
* ``gms.integrations.sglang``: SGLang's ``--load-format gms
  --enable-memory-saver`` (docs/sglang.md).
"""
