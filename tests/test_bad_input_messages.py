"""Small inputs that once failed with a bare Python error now get a clear message, or a sane value.

No ranks: each is checked before anything reaches the network.
"""

import pytest
import torch
from IPython.core.error import UsageError

from shardlab.cluster import magic
from shardlab.instruments.collectives import Call, _dtype_of


def test_ranks_magic_with_a_bad_timeout_says_how_to_call_it():
    class Shell:
        magics: dict = {}

        def register_magic_function(self, fn, magic_kind, magic_name):
            self.magics[(magic_kind, magic_name)] = fn

    shell = Shell()
    magic.register_ranks_magic(shell, lambda: pytest.fail("no cluster should be asked for"))
    with pytest.raises(UsageError, match=r"%%ranks \[timeout seconds\], got 'abc'"):
        shell.magics[("cell", "ranks")]("abc", "x = 1")


def test_a_coalesced_call_with_no_tensors_has_no_dtype_and_sends_nothing():
    assert _dtype_of([]) is None and _dtype_of([torch.ones(2, dtype=torch.bfloat16)]) == torch.bfloat16
    empty = Call("all_reduce", "allreduce_coalesced_", 0, 0, _dtype_of([]), 3)
    assert empty.ring_bytes == 0 and empty.record()["ring_bytes"] == 0
