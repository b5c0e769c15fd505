"""Integrations with serving engines: the vLLM load-format plugin (`--load-format wna16ctl`) that
serves a `repack --layout marlin` output directly.  Nothing here is imported by the commands; vLLM
imports it through the `vllm.general_plugins` entry point of the `wna16ctl[vllm]` extra.

`marlin_serving.py` holds what needs neither torch nor vLLM (reading the manifest, the engine
checks and the shapes each rank's tensors must have); `vllm_plugin.py` is the loader itself.
"""
