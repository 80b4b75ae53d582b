"""``%%ranks``: a notebook cell that runs on every rank of the current cluster.

A cell magic rather than only ``cluster.run_cell(...)``: learners write rank code as ordinary
cells (with ``rank``, ``world_size``, ``dist`` and ``torch`` already defined), and see each
rank's output labelled ``[rank r]``. :func:`~shardlab.cluster.start_cluster` registers it,
passing how to find the current cluster, so this file needs nothing of ``core.py``.
"""

from __future__ import annotations


def cell_name(shell) -> str:
    """``Cell In[n]``, the name IPython gives the running cell in its tracebacks: the number of
    the running cell's result (``displayhook.exec_result``). IPython 9 counts the cell before it
    runs it, so ``shell.execution_count`` is already the next cell's number; a cell run without
    history (``store_history=False``) takes no number, and its result holds the one it is named by."""
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return f"Cell In[{number if number is not None else getattr(shell, 'execution_count', '?')}]"


def register_ranks_magic(shell, get_cluster) -> None:
    """Register ``%%ranks`` in IPython ``shell`` (None: not under IPython, nothing to do);
    ``get_cluster()`` returns the cluster a cell runs on when it runs."""
    if shell is None or getattr(shell, "_shardlab_magic", False):
        return

    def ranks(line, cell):
        """%%ranks [timeout]: run this cell on every rank of the current cluster; output by rank."""
        try:
            timeout = float(line) if line.strip() else None
        except ValueError:
            from IPython.core.error import UsageError  # only ever called under IPython

            raise UsageError(f"%%ranks [timeout seconds], got {line.strip()!r}") from None
        # Named as Jupyter names the cell, body from line 2: a rank's traceback shows
        # "Cell In[10], line 3" and the line, as a failing ordinary cell would.
        get_cluster().run_cell(cell, timeout, name=cell_name(shell), first_line=2)

    shell.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    shell._shardlab_magic = True
