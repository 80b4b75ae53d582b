"""``python -m shardlab <command>``: the package's command line.

Each command lives in its own module, which exposes ``main(argv) -> int``; they are imported
only when used, so ``python -m shardlab memory`` does not pay for torch.distributed.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "memory": ("shardlab.instruments.memory_cli", "per-device model-state memory of DDP / ZeRO-1/2/3"),
    "figures": ("shardlab.bench.figures", "regenerate every PNG in figures/"),
    "bench": ("shardlab.bench.run", "ShardLab's stages against PyTorch's DDP, ZeRO and fully_shard"),
    "train": ("shardlab.train", "train the demo GPT at any stage (run it under torchrun)"),
    "slow-link": ("shardlab.bench.slow_link", "step time of stages 0 and 3 on emulated slow links vs the ring model"),
    "wire": ("shardlab.bench.wire_bytes", "bytes on the wire per rank, measured, beside the ring formula"),
    "plan": ("shardlab.planner.cli", "memory and step time of DDP / ZeRO / HSDP on 8 to 4096 GPUs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: python -m shardlab <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
