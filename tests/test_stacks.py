"""The stack-options table of notebook 05: every PyTorch name in it exists in the installed torch.

Two checks: the names each row lists (``torch``), and every call or enum member written in the
PyTorch cells (``fully_shard(``, ``ShardingStrategy.SHARD_GRAD_OP``, ``set_..._prefetch``), so
that a renamed or removed API is caught even if the row's list forgot it.
"""

import importlib
import re

import pytest

from shardlab.course import stacks

# Where the PyTorch cells' bare names live.
HOMES = ["torch.distributed.fsdp", "torch.distributed.fsdp.FSDPModule", "torch.nn.parallel",
         "torch.nn.parallel.DistributedDataParallel", "torch.distributed.optim", "torch.optim",
         "torch.distributed.device_mesh", "torch.utils.checkpoint", "torch"]


def resolve(path: str):
    """Import the longest module prefix of a dotted path, then walk the attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def resolve_bare(name: str):
    if name.startswith("torch."):
        return resolve(name)
    for home in HOMES:
        try:
            return resolve(f"{home}.{name}")
        except (ImportError, AttributeError):
            continue
    raise AttributeError(f"{name!r} is not in any of {HOMES}")


@pytest.mark.parametrize("name", stacks.torch_names())
def test_listed_torch_names_exist(name):
    assert resolve(name) is not None


def _cell_names(text: str) -> set[str]:
    calls = re.findall(r"([A-Za-z_]\w*(?:\.\w+)*)\s*\(", text)
    members = re.findall(r"\b([A-Z]\w+\.[A-Z_]{3,})\b", text)
    methods = re.findall(r"\b(set_\w+|no_sync)\b", text)
    names = {n.removeprefix("model.") for n in calls + members + methods}  # model.no_sync( -> no_sync
    return names - {"block", "model"}


def test_every_name_written_in_the_pytorch_cells_exists():
    names = {n for row in stacks.ROWS for key in ("fsdp2", "fsdp1") if row[key]
             for n in _cell_names(row[key][0])}
    assert {"fully_shard", "MixedPrecisionPolicy", "ShardingStrategy.SHARD_GRAD_OP",
            "ShardingStrategy.HYBRID_SHARD", "set_requires_gradient_sync"} <= names  # the parser works
    missing = []
    for name in sorted(names):
        try:
            resolve_bare(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"not in this torch: {missing}"


def test_rows_are_complete_and_link_their_docs():
    assert [r["shardlab"].split(" ")[0] for r in stacks.ROWS[:5]] == \
        ["stage=0", "stage=1", "stage=2", "stage=3,", "stage=3"]
    for row in stacks.ROWS:
        assert set(stacks.STACKS) <= set(row) and row["torch"]
        cells = [row[k] for k in stacks.STACKS if row[k] is not None]
        assert len(cells) >= 4, row["shardlab"]
        for setting, url in cells:
            assert setting and url.startswith("https://"), (row["shardlab"], setting)
    deepspeed_stages = [r["deepspeed"][0] for r in stacks.ROWS if r["deepspeed"] and '"stage"' in r["deepspeed"][0]]
    assert deepspeed_stages == [f'"zero_optimization": {{"stage": {s}}}' for s in range(4)]


def test_markdown_has_one_line_per_row_and_every_link():
    text = stacks.markdown()
    lines = text.splitlines()
    assert len(lines) == 2 + len(stacks.ROWS)
    assert all(line.count(" | ") == len(stacks.STACKS) for line in lines[2:])  # pipes inside cells escaped
    for row in stacks.ROWS:
        for key in stacks.STACKS:
            if row[key]:
                assert f"]({row[key][1]})" in text


def test_html_table_has_every_row_and_link():
    """The notebook shows the HTML table (the website renders Markdown output as a paragraph)."""
    page = stacks.html()
    assert page.count("<tr>") == 1 + len(stacks.ROWS)
    links = sum(row[k] is not None for row in stacks.ROWS for k in stacks.STACKS)
    assert page.count("<a href=") == links
    assert "`" not in page and "|" not in page.replace("\\|", "")


def test_stage_2_cells_that_offer_fsdp_say_it_shards_the_weights():
    """ZeRO-2 keeps whole weights between steps; FSDP's closest settings do not. A stage-2 cell
    that offers one of them must say so, or a learner takes it for ZeRO-2 itself."""
    row = next(r for r in stacks.ROWS if r["shardlab"].startswith("stage=2"))
    offers = {k: row[k][0] for k in stacks.STACKS
              if row[k] and re.search(r"shard_grad_op|reshard_after_forward|sharding_strategy", row[k][0], re.I)}
    assert {"fsdp1", "fsdp2"} <= set(offers)  # the search finds them
    for key, setting in offers.items():
        assert "shards weights between steps" in setting, (key, setting)
