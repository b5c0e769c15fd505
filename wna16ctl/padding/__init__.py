"""Exact zero-padding of a checkpoint's MLP intermediate sizes (`wna16ctl pad`).

A rank's slice of an MoE (or dense) MLP must hold whole scale groups and Marlin tiles; when the
intermediate size I does not split that way at the TP size wanted, padding I to a larger I'
with zeros makes it split, and changes nothing the model computes: the new gate/up rows
dequantise to 0, silu(0)·0 = 0, and the matching new down-projection columns multiply those
zeros.

* the plan (`planning.padding`, beside the other planners that `--suggest` also asks): the smallest
  I' per config field that loads at TP N under the release's rules (the planner's, re-run with the
  padded sizes), or a one-line refusal naming what padding cannot fix.
* `tensors`: the tensor math, per packed form (the zero code, new whole groups, g_idx, zero points).
* `blocks`: the same padding as byte ranges (original bytes in pieces, added bytes after each),
  without torch: what `write` writes.
* `stored`: the byte ranges of a projection stored in a form other than the canonical one (GPTQ,
  AWQ, AutoRound): the canonical padding written back through the format's `stored_form`.
* `write`: the streaming, atomic rewrite through `wna16ctl.output` (same format, new sizes).
* `proof`: `verify ORIGINAL PADDED`: originals unchanged, additions the zero code, same outputs.
"""
