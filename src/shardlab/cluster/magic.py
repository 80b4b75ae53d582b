"""``%%ranks``: a notebook cell that runs on every rank of the current cluster.

A cell magic rather than only ``cluster.run_cell(...)``: learners write rank code as ordinary
cells (with ``rank``, ``world_size``, ``dist`` and ``torch`` already defined), and see each
rank's output labelled ``[rank r]``. :func:`~shardlab.cluster.start_cluster` registers it.
"""

from __future__ import annotations

from shardlab.cluster.core import current
from shardlab.cluster.on_rank import _shell


def _register_magic() -> None:
    shell = _shell()
    if shell is None or getattr(shell, "_shardlab_magic", False):
        return

    def ranks(line, cell):
        """%%ranks [timeout]: run this cell on every rank of the current cluster; output by rank."""
        timeout = float(line) if line.strip() else None
        # Named as Jupyter names the cell, body from line 2: a rank's traceback shows
        # "Cell In[10], line 3" and the line, as a failing ordinary cell would.
        name = f"Cell In[{getattr(shell, 'execution_count', '?')}]"
        _, error = current()._submit("cell", (cell, name, 2), (), {}, {}, {}, timeout, show_values=True)
        if error is not None:
            raise error  # shown by the error's own _render_traceback_: the cell, not the runtime

    shell.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    shell._shardlab_magic = True
