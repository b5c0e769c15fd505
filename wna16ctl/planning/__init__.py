"""The planner: what a vLLM release does with each layer of a checkpoint, from headers alone.

* `rules`: the rulebook, every difference between vLLM releases as a dated change the planner executes.
* `moe`: one decision function for an MoE layer at one parallel configuration (backend, padding, w2 scale sharding).
* `linear`: the quantized linear layers around the experts and the engine's model-level TP checks.
* `inspection`: the planner run over a whole checkpoint for each TP size and release (`inspect`).
* `suggest`: for each refused TP size, the nearest single changes that load, re-planned (`inspect --suggest`).
* `tpsizes`: the one parser of `--tp` and the one check of a size against a checkpoint.

Reads no files: `sources` hands it configs and headers.
"""
