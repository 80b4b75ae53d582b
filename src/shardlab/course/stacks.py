"""The seed's "pick one stack and learn its options": ShardLab's settings in five real stacks.

Kept as data, not typed into a notebook's markdown, so that a test can check every PyTorch
name in it against the installed torch (``tests/test_stacks.py``) and a notebook renders it
(:func:`markdown`). Each cell is ``(setting, docs page)``; ``None`` means the stack has no
such setting. ``torch`` lists the importable names a row uses, as dotted paths.

The correspondences are close, not exact, and the notes say where: FSDP's
``reshard_after_forward=False`` and FSDP1's ``SHARD_GRAD_OP`` keep the gathered weights from
forward to backward but still shard them between steps, while ZeRO-2 keeps whole weights.
``prefetch=`` is ShardLab's argument, not an FSDP one. DeepSpeed's HSDP is MiCS; ZeRO++'s hpZ
only adds an in-node copy of the weights for backward's gather. The CPU-offload settings move
different things. FSDP1 is ``FullyShardedDataParallel`` (a flat parameter per wrapped module,
as ShardLab's units); FSDP2 is ``fully_shard`` (per-parameter DTensors sharded on dim 0).
"""

from __future__ import annotations

import re

STACKS = {
    "deepspeed": "DeepSpeed (JSON config)",
    "fsdp2": "PyTorch FSDP2 (`fully_shard`, per-parameter DTensor)",
    "fsdp1": "PyTorch FSDP1 (`FullyShardedDataParallel`, flat parameter) / DDP",
    "accelerate": "Hugging Face Accelerate",
    "lightning": "Lightning (`Trainer(strategy=...)`)",
}

DS = "https://www.deepspeed.ai/docs/config-json/#zero-optimizations-for-fp16-training"
DS_BF16 = "https://www.deepspeed.ai/docs/config-json/#bfloat16-training-options"
DS_ACT = "https://www.deepspeed.ai/docs/config-json/#activation-checkpointing"
DS_ZPP = "https://www.deepspeed.ai/tutorials/zeropp/"
DS_MICS = "https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/runtime/zero/config.py"
FSDP2 = "https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html"
FSDP1 = "https://docs.pytorch.org/docs/stable/fsdp.html"
DDP = "https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html"
ZRO = "https://docs.pytorch.org/docs/stable/distributed.optim.html"
CKPT = "https://docs.pytorch.org/docs/stable/checkpoint.html"
ACC_FSDP = "https://huggingface.co/docs/accelerate/usage_guides/fsdp"
ACC_DS = "https://huggingface.co/docs/accelerate/usage_guides/deepspeed"
ACC_GA = "https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation"
ACC_MP = "https://huggingface.co/docs/accelerate/basic_tutorials/launch"
L_DDP = "https://lightning.ai/docs/pytorch/stable/accelerators/gpu_intermediate.html"
L_DS = "https://lightning.ai/docs/pytorch/stable/advanced/model_parallel/deepspeed.html"
L_FSDP = "https://lightning.ai/docs/pytorch/stable/advanced/model_parallel/fsdp.html"
L_PREC = "https://lightning.ai/docs/pytorch/stable/common/precision_basic.html"
L_GA = "https://lightning.ai/docs/pytorch/stable/common/trainer.html#accumulate-grad-batches"
L_FSDP_API = "https://lightning.ai/docs/pytorch/stable/api/lightning.pytorch.strategies.FSDPStrategy.html"

ROWS = [
    {"shardlab": "stage=0 (DDP)",
     "deepspeed": ('"zero_optimization": {"stage": 0}', DS),
     "fsdp2": None,
     "fsdp1": ("DistributedDataParallel(model), or FSDP ShardingStrategy.NO_SHARD", DDP),
     "accelerate": ("plain `accelerate launch` on several GPUs (MULTI_GPU: DDP)", ACC_MP),
     "lightning": ('strategy="ddp"', L_DDP),
     "torch": ["torch.nn.parallel.DistributedDataParallel", "torch.distributed.fsdp.ShardingStrategy.NO_SHARD"]},
    {"shardlab": "stage=1 (optimizer state sharded)",
     "deepspeed": ('"zero_optimization": {"stage": 1}', DS),
     "fsdp2": None,
     "fsdp1": ("DDP + ZeroRedundancyOptimizer(params, optimizer_class=AdamW)", ZRO),
     "accelerate": ("DeepSpeedPlugin(zero_stage=1)", ACC_DS),
     "lightning": ('strategy="deepspeed_stage_1"', L_DS),
     "torch": ["torch.distributed.optim.ZeroRedundancyOptimizer"]},
    {"shardlab": "stage=2 (+ gradients sharded)",
     "deepspeed": ('"zero_optimization": {"stage": 2}', DS),
     "fsdp2": ("closest: fully_shard(block, reshard_after_forward=False) (also shards weights between steps)", FSDP2),
     "fsdp1": ("closest: ShardingStrategy.SHARD_GRAD_OP (also shards weights between steps)", FSDP1),
     "accelerate": ("DeepSpeedPlugin(zero_stage=2)", ACC_DS),
     "lightning": ('strategy="deepspeed_stage_2"', L_DS),
     "torch": ["torch.distributed.fsdp.ShardingStrategy.SHARD_GRAD_OP"]},
    {"shardlab": "stage=3, reshard_after_forward=False",
     "deepspeed": None,
     "fsdp2": ("fully_shard(block, reshard_after_forward=False)", FSDP2),
     "fsdp1": ("ShardingStrategy.SHARD_GRAD_OP", FSDP1),
     "accelerate": ("fsdp_version: 2, fsdp_reshard_after_forward: false", ACC_FSDP),
     "lightning": ('FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")', L_FSDP),
     "torch": ["torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.FSDPModule.set_reshard_after_forward"]},
    {"shardlab": "stage=3 (FSDP: + weights sharded)",
     "deepspeed": ('"zero_optimization": {"stage": 3}', DS),
     "fsdp2": ("fully_shard(block, reshard_after_forward=True) per block, then the root", FSDP2),
     "fsdp1": ("FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.FULL_SHARD)", FSDP1),
     "accelerate": ("fsdp_sharding_strategy: FULL_SHARD (FSDP2: fsdp_reshard_after_forward: true)", ACC_FSDP),
     "lightning": ('strategy="fsdp" or strategy="deepspeed_stage_3"', L_FSDP),
     "torch": ["torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.FullyShardedDataParallel",
               "torch.distributed.fsdp.ShardingStrategy.FULL_SHARD"]},
    {"shardlab": "prefetch=True (ShardLab's argument, not an FSDP one)",
     "deepspeed": ('"stage3_prefetch_bucket_size"', DS),
     "fsdp2": ("no argument. Backward: one module ahead, in reverse post-forward order, unless set. "
               "Forward: implicit on GPU through CUDA streams, none on CPU. Explicit: "
               "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch", FSDP2),
     "fsdp1": ("backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True", FSDP1),
     "accelerate": ("fsdp_backward_prefetch: BACKWARD_PRE", ACC_FSDP),
     "lightning": ("FSDPStrategy(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True): "
                   "extra arguments go to FSDP1", L_FSDP_API),
     "torch": ["torch.distributed.fsdp.FSDPModule.set_modules_to_forward_prefetch",
               "torch.distributed.fsdp.FSDPModule.set_modules_to_backward_prefetch",
               "torch.distributed.fsdp.BackwardPrefetch.BACKWARD_PRE"]},
    {"shardlab": "mixed_precision=torch.bfloat16",
     "deepspeed": ('"bf16": {"enabled": true}', DS_BF16),
     "fsdp2": ("mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)", FSDP2),
     "fsdp1": ("mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)", FSDP1),
     "accelerate": ('Accelerator(mixed_precision="bf16")', ACC_MP),
     "lightning": ('Trainer(precision="bf16-mixed")', L_PREC),
     "torch": ["torch.distributed.fsdp.MixedPrecisionPolicy", "torch.distributed.fsdp.MixedPrecision"]},
    {"shardlab": "with model.no_sync(): (gradient accumulation)",
     "deepspeed": ('"gradient_accumulation_steps"', "https://www.deepspeed.ai/docs/config-json/#batch-size-related-parameters"),
     "fsdp2": ("model.set_requires_gradient_sync(False)", FSDP2),
     "fsdp1": ("with model.no_sync():", FSDP1),
     "accelerate": ("with accelerator.accumulate(model):", ACC_GA),
     "lightning": ("Trainer(accumulate_grad_batches=N)", L_GA),
     "torch": ["torch.distributed.fsdp.FSDPModule.set_requires_gradient_sync",
               "torch.distributed.fsdp.FullyShardedDataParallel.no_sync",
               "torch.nn.parallel.DistributedDataParallel.no_sync"]},
    {"shardlab": "shardlab.checkpoint_units(model)",
     "deepspeed": ('"activation_checkpointing" (with deepspeed.checkpointing.checkpoint)', DS_ACT),
     "fsdp2": ("torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) in each block", CKPT),
     "fsdp1": ("torch.utils.checkpoint.checkpoint, as for FSDP2", CKPT),
     "accelerate": ("fsdp_activation_checkpointing: true", ACC_FSDP),
     "lightning": ("FSDPStrategy(activation_checkpointing_policy={Block})", L_FSDP),
     "torch": ["torch.utils.checkpoint.checkpoint"]},
    {"shardlab": "(notebook 07) HSDP: shard in a node, replicate across",
     "deepspeed": ('MiCS: "mics_shard_size". Not ZeRO++ hpZ ("zero_hpz_partition_size"): hpZ only keeps '
                   "a second, in-node copy of the weights for backward's gather", DS_MICS),
     "fsdp2": ("fully_shard(block, mesh=init_device_mesh(\"cuda\", (replicas, gpus_per_node)))", FSDP2),
     "fsdp1": ("ShardingStrategy.HYBRID_SHARD", FSDP1),
     "accelerate": ("fsdp_sharding_strategy: HYBRID_SHARD", ACC_FSDP),
     "lightning": ('FSDPStrategy(sharding_strategy="HYBRID_SHARD")', L_FSDP),
     "torch": ["torch.distributed.device_mesh.init_device_mesh", "torch.distributed.fsdp.ShardingStrategy.HYBRID_SHARD"]},
    {"shardlab": "(notebook 07) CPU offload",
     "deepspeed": ('"offload_optimizer": {"device": "cpu"}: optimizer state and its step on CPU, weights on GPU; '
                   'closer to FSDP\'s: "offload_param" at stage 3', DS),
     "fsdp2": ("offload_policy=CPUOffloadPolicy(): a different design, sharded weights, gradients and "
               "optimizer state all on CPU, the optimizer step on CPU", FSDP2),
     "fsdp1": ("cpu_offload=CPUOffload(offload_params=True): weights and gradients on CPU, as FSDP2", FSDP1),
     "accelerate": ("fsdp_offload_params: true", ACC_FSDP),
     "lightning": ('strategy="deepspeed_stage_2_offload"', L_DS),
     "torch": ["torch.distributed.fsdp.CPUOffloadPolicy", "torch.distributed.fsdp.CPUOffload"]},
]


def _code(text: str) -> str:
    """A name as a code span; prose that already holds code spans stays prose (no nested backticks)."""
    return text if "`" in text else f"`{text}`"


def markdown() -> str:
    """The table as Markdown: one row per ShardLab setting, each cell linking its docs page."""
    head = "| ShardLab | " + " | ".join(STACKS.values()) + " |"
    lines = [head, "|" + "---|" * (len(STACKS) + 1)]
    for row in ROWS:
        cells = [f"`{row['shardlab']}`"]
        for key in STACKS:
            cell = row[key]
            cells.append("—" if cell is None else f"[{_code(cell[0])}]({cell[1]})".replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def html() -> str:
    """The same table as HTML, for notebook and website output.

    MyST-NB (the website) renders a cell's ``text/markdown`` output as CommonMark, which has no
    tables: the Markdown table came out as one paragraph of pipes. HTML renders the same in
    JupyterLab and on the site.
    """
    from html import escape

    def cell(value) -> str:
        return "—" if value is None else f'<a href="{escape(value[1])}"><code>{escape(value[0].replace("`", ""))}</code></a>'

    def name(text: str) -> str:  # the headers' `code` spans, as HTML
        return re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(text))

    head = "".join(f"<th>{name(n)}</th>" for n in ("ShardLab", *STACKS.values()))
    body = "".join(
        f"<tr><td><code>{escape(row['shardlab'])}</code></td>" + "".join(f"<td>{cell(row[k])}</td>" for k in STACKS) + "</tr>"
        for row in ROWS)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def show():
    """Render the table in a notebook: HTML, with the Markdown as its plain-text fallback."""
    try:
        from IPython.display import display
    except ImportError:  # pragma: no cover - the course always has IPython
        print(markdown())
        return
    display({"text/html": html(), "text/plain": markdown()}, raw=True)


def torch_names() -> list[str]:
    """Every PyTorch name the table uses, once, in table order."""
    return list(dict.fromkeys(name for row in ROWS for name in row["torch"]))
