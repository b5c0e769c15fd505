"""`repack`: plan, stream the experts, lay them out per rank, hand them to `output`.

* `pipeline`: the validation pass, the plan, the torch data path and the run (`run_repack`).
* `native_path`: the torch-free data path over the native host library.
* `distributed`: one repack across torchrun processes.
* `parts`: outputs holding some of the ranks, and joining them.
"""
