"""ShardLab: ZeRO-1/2/3 and FSDP built from scratch on torch.distributed, to be read and measured."""

__version__ = "0.1.0"
