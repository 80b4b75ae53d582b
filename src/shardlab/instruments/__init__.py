"""The instruments: formulas and live measurements of memory, traffic and time (see README.md here)."""
