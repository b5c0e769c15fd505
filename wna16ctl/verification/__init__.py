"""`verify`: proof that a repack output equals its source.

* `checks`: the manifest and hashes, the bit-exact round trip, the numerics of every layer, the report.
* `e2e`: the model itself, with the source's and the repacked experts, compared token by token.
* `activations`: the activations the numerics and e2e use, built from GSM8K text.
* `samples`: where the questions come from (the search order), torch-free.
"""
