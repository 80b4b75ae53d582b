"""The engine: ZeRO-0/1/2/3 built from scratch on torch.distributed (read README.md here for the order)."""
