"""What the course notebooks and labs import: quizzes, the memory calculator, lab checkers.

``from shardlab.course import quiz`` and ``shardlab.course.memory_calculator(7e9, gpus=8)``.
"""

_CALCULATOR = ("memory_calculator", "calculator_widget")


def __getattr__(name: str):
    if name in _CALCULATOR:  # imported on first use: the calculator pulls in matplotlib only then
        from shardlab.course import calculator

        return getattr(calculator, name)
    raise AttributeError(f"module 'shardlab.course' has no attribute {name!r}")
