"""wna16ctl: inspect, repack and verify WNA16 (int4/int8 weight-only) compressed-tensors MoE checkpoints."""

__version__ = "0.1.0"
