"""What the course notebooks and labs import: quizzes, the memory calculator, lab checkers.

``from shardlab.course import quiz`` and ``shardlab.course.memory_calculator(7e9, gpus=8)``.
"""

import importlib

# Imported on first use: the calculator pulls in matplotlib, and its widget ipywidgets, only then.
# No function here shares its name with a module of this package: importing a submodule sets
# the package attribute of that name, which would replace the function after its first call.
_LAZY = {"memory_calculator": "shardlab.course.calculator",
         "calculator_widget": "shardlab.course.calculator_widgets"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardlab.course' has no attribute {name!r}")
