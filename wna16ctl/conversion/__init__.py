"""`wna16ctl convert`: GPTQ, AWQ and AutoRound checkpoints to compressed-tensors `pack-quantized`,
every code, scale, zero point and g_idx carried exactly.

* `plan`: what is written, from the headers: each quantized projection's pack-quantized tensors,
  the `quantization_config` llm-compressor writes for the same schemes (checked against the
  library's matching), and the one-line refusals where compressed-tensors cannot say the source.
* `write`: the streaming, atomic, resumable rewrite through `wna16ctl.output` (a projection at a
  time through its format's canonical form, which is the pack-quantized form).
* `proof`: `verify ORIGINAL CONVERTED`: every tensor carried exactly, and compressed-tensors' own
  decompression of the output equal to the source's dequantization.
"""
